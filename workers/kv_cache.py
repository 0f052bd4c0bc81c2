"""PagePool: one pool of physical KV pages, its free list and the per-page owner tags.

The allocator copies SGLang's ``PagedTokenToKVPoolAllocator`` on purpose, because the leak depends
on it: freed pages are handed back WITHOUT zeroing, and the most recently freed batch goes to the
front of the free list (``free = freed + free``) while ``alloc`` takes from the front. So when request
A frees its pages and B then allocates as many, B gets A's pages in A's order, still holding A's data.

Page 0 is the scratch page, as SGLang reserves its padding slot: it is never allocated, never written
and stays zero. Block tables are padded with it, and owner verification redirects reads of pages that
fail the check to it.

Owner tags live on the device beside K/V so that verification needs no host round trip:

- ``owner_request`` (int64): the request that last WROTE the page; 0 = nobody since start or zeroing.
- ``owner_tenant`` (int32): that request's tenant index; 0 = none.
- ``filled`` (int32): how many leading slots of the page the current owner has written.

``owner_request`` and ``filled`` are stored packed in one int64 word per page,
``owner_request * (page_size + 1) + filled`` (``ownership_word``), so that verification compares one
gathered word per page with the exact word the reader expects; the two tags are read back through
properties.

Tags change on write (prefill, transfer, decode), never on allocation: an allocated page that still
carries another request's tag is exactly a dirty reuse, which ``alloc`` counts. The one other change
is publication to the prefix cache (``workers.prefix_cache``), which gives a page a negative owner,
the cache entry's number, so that a page many requests read names none of them; an evicted cached
page therefore counts as dirty too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the pools a configuration asks for
    from kvcanary.workers.config import WorkerConfig

SCRATCH_PAGE = 0


class PagePool:
    """K/V tensors shaped ``[num_pages + 1, page_size, head_dim]`` (page 0 = scratch) with a LIFO free list.

    Only the engine thread mutates a pool. ``pages_allocated`` and ``pages_reused_dirty`` are plain
    counters that the metrics collector reads at scrape time.
    """

    def __init__(
        self,
        *,
        name: str,
        num_pages: int,
        page_size: int,
        head_dim: int,
        device: torch.device | str,
        zero_freed_pages: bool = False,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"pool {name!r} needs at least one page, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.zero_freed_pages = zero_freed_pages
        shape = (num_pages + 1, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.ownership = torch.zeros(num_pages + 1, dtype=torch.int64, device=self.device)
        self.owner_tenant = torch.zeros(num_pages + 1, dtype=torch.int32, device=self.device)
        # The front of the free list is the END of this Python list, so alloc and free stay O(pages moved).
        self._free_stack: list[int] = list(range(num_pages, 0, -1))
        self.pages_allocated = 0
        self.pages_reused_dirty = 0

    def ownership_word(
        self, request_id: int | torch.Tensor, filled: int | torch.Tensor
    ) -> int | torch.Tensor:
        """Return the packed tag of a page owned by ``request_id`` with ``filled`` leading slots written."""
        return request_id * (self.page_size + 1) + filled

    @property
    def owner_request(self) -> torch.Tensor:
        """Return ``[num_pages + 1]`` int64: the request that last wrote each page (0 = none; a negative
        value ``-e`` = prefix cache entry ``e``)."""
        return torch.div(self.ownership, self.page_size + 1, rounding_mode="floor")

    @property
    def filled(self) -> torch.Tensor:
        """Return ``[num_pages + 1]`` int32: leading slots of each page written by its owner."""
        return (self.ownership % (self.page_size + 1)).to(torch.int32)

    @property
    def capacity_tokens(self) -> int:
        """Return the tokens the pool holds (scratch page excluded)."""
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        """Return how many pages are free right now."""
        return len(self._free_stack)

    def free_list(self) -> list[int]:
        """Return the free list front first (the order ``alloc`` hands pages out); for tests and debugging."""
        return self._free_stack[::-1]

    def pages_for(self, num_tokens: int) -> int:
        """Return how many pages hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def can_alloc(self, num_pages: int) -> bool:
        """Return True when ``num_pages`` pages are free right now."""
        return num_pages <= len(self._free_stack)

    def alloc(self, num_pages: int, *, request_id: int) -> list[int]:
        """Take ``num_pages`` pages from the front of the free list; their old data and tags stay.

        Counts every page that still carries another request's tag as reused dirty. Raises
        ``RuntimeError`` when fewer pages are free (callers check ``can_alloc`` first).
        """
        if num_pages > len(self._free_stack):
            raise RuntimeError(f"pool {self.name!r}: {num_pages} pages asked, {len(self._free_stack)} free")
        if num_pages == 0:
            return []
        pages = self._free_stack[-num_pages:][::-1]
        del self._free_stack[-num_pages:]
        owners = torch.div(
            self.ownership[torch.tensor(pages, device=self.device)], self.page_size + 1, rounding_mode="floor"
        )
        dirty = int(((owners != 0) & (owners != request_id)).sum().item())
        self.pages_allocated += num_pages
        self.pages_reused_dirty += dirty
        return pages

    def free(self, pages: list[int]) -> None:
        """Give ``pages`` back, prepended in their order (LIFO), zeroed only with ``zero_freed_pages``."""
        if not pages:
            return
        if self.zero_freed_pages:
            index = torch.tensor(pages, device=self.device)
            self.k[index] = 0
            self.v[index] = 0
            self.ownership[index] = 0
            self.owner_tenant[index] = 0
        self._free_stack.extend(reversed(pages))

    def record_write(
        self,
        pages: torch.Tensor,
        start: torch.Tensor,
        end: torch.Tensor,
        *,
        request_id: int | torch.Tensor,
        tenant_index: int | torch.Tensor,
    ) -> None:
        """Tag ``pages`` as written by the request in slots ``[start, end)`` of each (vectors, same length).

        A page the request already owns grows its ``filled`` prefix when the write touches or extends
        it; a page owned by someone else changes owner and ``filled`` restarts from this write (``end``
        when it starts at slot 0, else 0, since the leading slots are not this request's). ``pages``
        must not repeat within one call.
        """
        current = self.ownership[pages]
        base = self.ownership_word(request_id, 0)
        filled = current - base  # in [0, page_size] exactly when the request owns the page already
        same_owner = (filled >= 0) & (filled <= self.page_size)
        grown = torch.where(start <= filled, torch.maximum(filled, end), filled)
        fresh = torch.where(start == 0, end, torch.zeros_like(end))
        self.ownership[pages] = base + torch.where(same_owner, grown, fresh)
        self.owner_tenant[pages] = (
            tenant_index if isinstance(tenant_index, int) else tenant_index.to(torch.int32)
        )

    def holds_words(self, pages: list[int], words: list[int]) -> bool:
        """Return True when each of ``pages`` holds exactly the ownership word at its index in ``words``."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        expected = torch.tensor(words, dtype=torch.int64, device=self.device)
        return bool(torch.equal(self.ownership.index_select(0, index), expected))

    def slot_index(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        """Return the flat slot index (``page * page_size + slot``) of positions ``[0, num_tokens)``."""
        positions = torch.arange(num_tokens, device=self.device)
        table = torch.tensor(pages, device=self.device)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def write_prefix(
        self, pages: list[int], k: torch.Tensor, v: torch.Tensor, *, request_id: int, tenant_index: int
    ) -> None:
        """Write K/V rows for positions ``[0, len(k))`` through the block table ``pages`` and tag them."""
        num_tokens = k.shape[0]
        slots = self.slot_index(pages, num_tokens)
        self.k.view(-1, self.head_dim)[slots] = k
        self.v.view(-1, self.head_dim)[slots] = v
        self.record_prefix_write(pages, num_tokens, request_id=request_id, tenant_index=tenant_index)

    def record_prefix_write(
        self, pages: list[int], num_tokens: int, *, request_id: int, tenant_index: int
    ) -> None:
        """Tag the pages that positions ``[0, num_tokens)`` touch as written from slot 0."""
        used = self.pages_for(num_tokens)
        written = pages[:used]
        ends = [self.page_size] * used
        if used:
            ends[-1] = num_tokens - (used - 1) * self.page_size
        self.record_write(
            torch.tensor(written, device=self.device),
            torch.zeros(used, dtype=torch.int64, device=self.device),
            torch.tensor(ends, dtype=torch.int64, device=self.device),
            request_id=request_id,
            tenant_index=tenant_index,
        )


def build_pools(config: WorkerConfig, device: torch.device, head_dim: int) -> dict[str, PagePool]:
    """Return the pools ``config`` asks for by name (``unified``, or ``prefill`` and ``decode``)."""
    return {
        name: PagePool(
            name=name,
            num_pages=tokens // config.page_size,
            page_size=config.page_size,
            head_dim=head_dim,
            device=device,
            zero_freed_pages=config.zero_freed_pages,
        )
        for name, tokens in config.pool_tokens.items()
    }
