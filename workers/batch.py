"""RunningBatch: the requests decoding together, and their block tables kept on the device.

This is where tenants meet: continuous batching puts requests of different tenants into one
attention call, so the block table of each row is the only thing keeping them apart.

Row ``i`` of ``table`` is the decode block table of ``requests[i]``, padded with the scratch page.
Rows stay compact (a leaving request's row is filled by the last one), so a step's block tables are
the view ``table[:B, :P]`` with no per-step copy.

With ownership verification the batch also keeps, per row and page, the lowest ownership word the
page may hold when the row reads it (``expected_low``; see ``workers.model.entries_owned``): set when
the request joins (it reads its ``decode_len`` prompt tokens) and, each step, raised for the page of
the newest token with one small device write. The highest word allowed is the same for a whole row,
``word(request, page_size)`` (``expected_high``, ``[max_batch, 1]``).
"""

from __future__ import annotations

from array import array

import torch

from workers.kv_cache import SCRATCH_PAGE, PagePool
from workers.model import DecodeStep
from workers.request import Request

UNCHECKED_LOW = torch.iinfo(torch.int64).min
StepViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # block tables, lower and upper bounds


class RunningBatch:
    """At most ``max_batch`` requests and a ``[max_batch, max_pages]`` int64 block-table tensor."""

    def __init__(self, *, max_batch: int, pool: PagePool, verify_ownership: bool) -> None:
        self.max_batch = max_batch
        self.pool = pool
        self.page_size = pool.page_size
        self.device = pool.device
        self.verify_ownership = verify_ownership
        shape = (max_batch, pool.num_pages)
        self.table = torch.full(shape, SCRATCH_PAGE, dtype=torch.int64, device=self.device)
        # The bounds exist only with verification: at a 2M-token pool they weigh 64 MB per 64 rows.
        bounds_shape = shape if verify_ownership else (0, 0)
        self.expected_low = torch.full(bounds_shape, UNCHECKED_LOW, dtype=torch.int64, device=self.device)
        self.expected_high = torch.zeros((bounds_shape[0], 1), dtype=torch.int64, device=self.device)
        # put_ takes row-major flat indices (row * width + page): it raises the frontier bounds in one
        # op per step, where view + index_copy_ cost two dispatches.
        self._width = shape[1]
        self._word_base = pool.page_size + 1  # word(request, filled) = request * _word_base + filled
        self._cached_views: tuple[tuple[int, int], StepViews] | None = None
        self.requests: list[Request] = []

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def full(self) -> bool:
        """Return True when no request can join until one leaves."""
        return len(self.requests) >= self.max_batch

    def add(self, request: Request) -> None:
        """Append ``request`` as the last row; its ``pages`` become that row of the table."""
        row = len(self.requests)
        self.table[row].fill_(SCRATCH_PAGE)
        self.table[row, : len(request.pages)] = self._tensor(request.pages)
        if self.verify_ownership:
            low = self._initial_low(request)
            self.expected_low[row].fill_(UNCHECKED_LOW)
            self.expected_low[row, : len(low)] = self._tensor(low)
            self.expected_high[row] = self._word(request.request_id, self.page_size)
        self.requests.append(request)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _initial_low(self, request: Request) -> list[int]:
        """Return a joining row's lower bounds for the pages its ``decode_len`` prompt tokens fill."""
        length, size = request.plan.decode_len, self.page_size
        return [
            self._word(request.request_id, min(size, length - j * size)) for j in range(-(-length // size))
        ]

    def _word(self, request_id: int, filled: int) -> int:
        return request_id * self._word_base + filled

    def remove(self, rows: list[int]) -> None:
        """Drop the requests at ``rows``, moving the last rows into the gaps to keep the table compact."""
        for row in sorted(rows, reverse=True):
            last = len(self.requests) - 1
            if row != last:
                self.table[row] = self.table[last]
                if self.verify_ownership:
                    self.expected_low[row] = self.expected_low[last]
                    self.expected_high[row] = self.expected_high[last]
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
        if self.verify_ownership:
            base, width = self._word_base, self._width
            columns.append([row * width + p // size for row, _, p in writers])
            columns.append([r.request_id * base + p % size + 1 for _, r, p in writers])
        b, w = len(requests), len(writers)
        # array + frombuffer converts in C: several times faster than torch.tensor(list), every step.
        flat = array("q", [v for column in columns for v in column])
        packed = torch.frombuffer(flat, dtype=torch.int64).to(self.device)
        # One unbind per group instead of an indexing op per column: each torch op costs microseconds.
        seq_lens_t, query_positions = packed[: 2 * b].view(2, b).unbind(0)
        writes = packed[2 * b :].view(len(columns) - 2, w).unbind(0)
        table, low, high = self._views(b, -(-max(seq_lens) // size))
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
            if w:
                # The newest token's page is now read up to its slot: raise that page's lower bound.
                self.expected_low.put_(writes[6], writes[7])
            step.expected_low, step.expected_high, step.entries_checked = low, high, table.numel()
        return step

    def _views(self, batch: int, span: int) -> StepViews:
        """Return the step's views of table, lower and upper bounds; they change only every few steps."""
        if self._cached_views is None or self._cached_views[0] != (batch, span):
            views = (self.table[:batch, :span], self.expected_low[:batch, :span], self.expected_high[:batch])
            self._cached_views = ((batch, span), views)
        return self._cached_views[1]
