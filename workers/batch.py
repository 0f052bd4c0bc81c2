"""RunningBatch: the requests decoding together, and their block tables kept on the device.

This is where tenants meet: continuous batching puts requests of different tenants into one
attention call, so the block table of each row is the only thing keeping them apart.

Row ``i`` of ``table`` is the decode block table of ``requests[i]``, padded with the scratch page.
Rows stay compact (a leaving request's row is filled by the last one), so a step's block tables are
the view ``table[:B, :P]`` with no per-step copy. Rows are as wide as one request's largest
reservation, not as the pool: a step's view is then nearly contiguous.

With ownership verification the batch also keeps, per row and page, the EXACT ownership word the
page must hold when the row reads it (``expected``; see ``workers.model.entries_owned``):

- pages the row reads: the request itself with every slot it reads written, ``word(r, n)``; or,
  for a page the prefix cache owns (aggregated mode), the word the cache gave it when it published it
  (see ``workers.prefix_cache``), which any number of rows may expect at once;
- pages allocated ahead and not written yet: the word they held when the request joined (nobody may
  write them but the request);
- scratch padding: 0 (the scratch page is never written).

Each step the newest token's page is written by its request, so its expected word is raised to
``word(r, slot + 1)``: a plain store on the CPU, one ``put_`` on a GPU (see ``_expected_words``).
Nothing else changes while a request runs.

Pages a row holds are kept apart by how it holds them: its own pages (``_held``), which nobody else
may hold, and cached pages (``_shared``, counted per row), which rows may share but none may be
given as its own.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Collection

import torch

from kvcanary.workers.kv_cache import SCRATCH_PAGE, PagePool
from kvcanary.workers.model import DecodeStep
from kvcanary.workers.request import Request

StepViews = tuple[torch.Tensor, torch.Tensor]  # block tables, expected ownership words


class PagesRefused(Exception):
    """A request is refused for the pages it was given, before it reads them (HTTP 500).

    ``held`` lists the pages among them that running rows hold: the request must not free those.
    """

    def __init__(self, message: str, held: list[int]) -> None:
        super().__init__(message)
        self.held = held


class SharedPages(PagesRefused):
    """The allocator handed a page out twice: to a running row and a joining request, or twice to one.

    ``held`` lists the pages running rows hold (empty when one request got the same page twice).
    """

    def __init__(self, request_id: int, held: list[int]) -> None:
        where = f"pages {held} that running rows hold" if held else "one page twice"
        super().__init__(f"request {request_id} was given {where}", held)


class ForeignPages(PagesRefused):
    """Prefill pages a transfer was about to read do not hold the words the request expects."""

    def __init__(self, request_id: int) -> None:
        super().__init__(f"request {request_id}: prefill pages not owned as expected before transfer", [])


class RunningBatch:
    """At most ``max_batch`` requests and a ``[max_batch, max_pages]`` int64 block-table tensor.

    ``max_pages`` bounds one request's pages (its reservation never exceeds the context window or
    the pool). ``entries_checked`` counts the block-table entries verified so far; the metrics
    collector reads it at scrape time, which keeps a lock out of the decode loop.
    """

    def __init__(
        self,
        *,
        max_batch: int,
        max_pages: int,
        pool: PagePool,
        verify_ownership: bool,
        host_stores: bool,
    ) -> None:
        self.max_batch = max_batch
        self.pool = pool
        self.page_size = pool.page_size
        self.device = pool.device
        self.verify_ownership = verify_ownership
        shape = (max_batch, max_pages)
        self.table = torch.full(shape, SCRATCH_PAGE, dtype=torch.int64, device=self.device)
        self.expected, self._expected_stores = self._expected_words(shape, host_stores)
        self._width = max_pages
        self._word_base = pool.page_size + 1  # word(request, filled) = request * _word_base + filled
        self._cached_views: tuple[tuple[int, int], StepViews] | None = None
        self.requests: list[Request] = []
        self.entries_checked = 0
        # Pages of the running rows, kept with verification only: their own, and cached (shared) ones.
        self._held: set[int] = set()
        self._shared: Counter[int] = Counter()

    def _expected_words(
        self, shape: tuple[int, int], host_stores: bool
    ) -> tuple[torch.Tensor, memoryview | None]:
        """Return the expected-words tensor and, where the interpreter can write it directly, its slots.

        With ``host_stores`` (the engine's choice on a CPU) the tensor lives in a bytearray: raising a
        row's frontier word is then a plain store, where a torch op costs about ten microseconds
        once a decode step's gathers have evicted the caches. On a GPU the words are raised with
        one ``put_`` per step instead, from columns of the step's single host-to-device copy.
        """
        if not self.verify_ownership:
            return torch.zeros((0, 0), dtype=torch.int64, device=self.device), None
        if not host_stores:
            return torch.zeros(shape, dtype=torch.int64, device=self.device), None
        if self.device.type != "cpu":
            raise ValueError("host stores need the expected words in host memory (device cpu)")
        storage = bytearray(8 * shape[0] * shape[1])
        return torch.frombuffer(storage, dtype=torch.int64).view(shape), memoryview(storage).cast("q")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def full(self) -> bool:
        """Return True when no request can join until one leaves."""
        return len(self.requests) >= self.max_batch

    def refuse_shared(self, request_id: int, pages: list[int], shared: Collection[int] = ()) -> None:
        """Raise ``SharedPages`` (with verification) when ``pages`` name one page twice, or a running
        row holds one of them in a way that forbids it.

        ``shared`` are the indices of the pages the request got from the prefix cache: those may be
        cached pages other rows read too, but never a row's own page. Its other pages are its own and
        no running row may hold them at all. The engine asks right after allocating, before anything
        is written into the pages. The per-step check cannot settle this case on a GPU: two rows
        writing one page in one step leave the data of one and, possibly, the tag of the other.
        """
        if not self.verify_ownership:
            return
        own = {page for index, page in enumerate(pages) if index not in shared}
        clash = self._held.intersection(pages) | own.intersection(self._shared)
        if len(set(pages)) < len(pages) or clash:
            raise SharedPages(request_id, sorted(clash))

    def add(self, request: Request) -> None:
        """Append ``request`` as the last row; its ``pages`` become that row of the table."""
        row, pages = len(self.requests), request.pages
        if len(pages) > self._width:
            raise ValueError(f"request {request.request_id}: {len(pages)} pages, rows hold {self._width}")
        self.table[row].fill_(SCRATCH_PAGE)
        self.table[row, : len(pages)] = self._tensor(pages)
        if self.verify_ownership:
            read = self._read_words(request)
            self.expected[row].zero_()
            self.expected[row, : len(read)] = self._tensor(read)
            # Pages allocated ahead still hold their previous writer's tag: that tag must stay put.
            ahead = self._tensor(pages[len(read) :])
            self.expected[row, len(read) : len(pages)] = self.pool.ownership[ahead]
            self._hold(request, 1)
        self.requests.append(request)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _hold(self, request: Request, change: int) -> None:
        """Count ``request``'s pages as held by its row (``change`` 1) or no longer (-1)."""
        for index, page in enumerate(request.pages):
            if index in request.shared_words:
                self._shared[page] += change
                if self._shared[page] <= 0:
                    del self._shared[page]
            elif change > 0:
                self._held.add(page)
            else:
                self._held.discard(page)

    def _read_words(self, request: Request) -> list[int]:
        """Return the words of the pages a joining row reads: its ``decode_len`` prompt tokens, its own
        or, where the prefix cache owns the page, the cache's."""
        length, size, shared = request.plan.decode_len, self.page_size, request.shared_words
        return [
            shared.get(j, self._word(request.request_id, min(size, length - j * size)))
            for j in range(-(-length // size))
        ]

    def _word(self, request_id: int, filled: int) -> int:
        return request_id * self._word_base + filled

    def remove(self, rows: list[int]) -> None:
        """Drop the requests at ``rows``, moving the last rows into the gaps to keep the table compact."""
        for row in sorted(rows, reverse=True):
            if self.verify_ownership:
                self._hold(self.requests[row], -1)
            last = len(self.requests) - 1
            if row != last:
                self.table[row] = self.table[last]
                if self.verify_ownership:
                    self.expected[row] = self.expected[last]
                self.requests[row] = self.requests[last]
            self.requests.pop()

    def decode_step(self) -> DecodeStep:
        """Build the device tensors of the next step with a single host-to-device copy."""
        requests, size = self.requests, self.page_size
        seq_lens = [r.seq_len for r in requests]
        writers = [(row, r, r.seq_len - 1) for row, r in enumerate(requests) if r.generated]
        columns = [
            seq_lens,
            [len(r.generated) for r in requests],
            [r.pages[p // size] for _, r, p in writers],
            [p % size for _, _, p in writers],
            [p for _, _, p in writers],
            [r.generated[-1] for _, r, _ in writers],
            [r.request_id for _, r, _ in writers],
            [r.tenant_index for _, r, _ in writers],
        ]
        stores, base, width = self._expected_stores, self._word_base, self._width
        # The newest token's page now holds its request's slots up to the one just written.
        if stores is not None:
            for row, r, p in writers:
                stores[row * width + p // size] = r.request_id * base + p % size + 1
        elif self.verify_ownership:
            columns.append([row * width + p // size for row, _, p in writers])  # put_ takes flat indices
            columns.append([r.request_id * base + p % size + 1 for _, r, p in writers])
        b, w = len(requests), len(writers)
        # array + frombuffer converts in C: several times faster than torch.tensor(list), every step.
        flat = array("q", [v for column in columns for v in column])
        packed = torch.frombuffer(flat, dtype=torch.int64).to(self.device)
        # One unbind per group instead of an indexing op per column: each torch op costs microseconds.
        seq_lens_t, query_positions = packed[: 2 * b].view(2, b).unbind(0)
        writes = packed[2 * b :].view(len(columns) - 2, w).unbind(0)
        table, expected = self._views(b, -(-max(seq_lens) // size))
        pages, slots, positions, tokens, writer_ids, tenants = writes[:6]
        step = DecodeStep(
            block_tables=table,
            seq_lens=seq_lens_t,
            query_positions=query_positions,
            write_pages=pages,
            write_slots=slots,
            write_positions=positions,
            write_tokens=tokens,
            write_request_ids=writer_ids,
            write_tenants=tenants,
        )
        if self.verify_ownership:
            if w and stores is None:
                self.expected.put_(writes[6], writes[7])
            step.expected_words = expected
            self.entries_checked += table.numel()
        return step

    def _views(self, batch: int, span: int) -> StepViews:
        """Return the step's views of table and expected words; they change only every few steps."""
        if self._cached_views is None or self._cached_views[0] != (batch, span):
            views = (self.table[:batch, :span], self.expected[:batch, :span])
            self._cached_views = ((batch, span), views)
        return self._cached_views[1]
