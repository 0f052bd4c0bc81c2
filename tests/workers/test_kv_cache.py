"""PagePool: SGLang's LIFO free list, owner tags set on write, ``filled``, zeroing, dirty reuse."""

from __future__ import annotations

import torch

from kvcanary.workers.kv_cache import SCRATCH_PAGE, PagePool


def make_pool(**overrides: object) -> PagePool:
    options: dict[str, object] = {
        "name": "test",
        "num_pages": 8,
        "page_size": 4,
        "head_dim": 2,
        "device": "cpu",
    }
    options.update(overrides)
    return PagePool(**options)  # type: ignore[arg-type]


def write(pool: PagePool, pages: list[int], tokens: int, request_id: int, tenant: int = 1) -> None:
    k = torch.full((tokens, pool.head_dim), float(request_id))
    pool.write_prefix(pages, k, k.clone(), request_id=request_id, tenant_index=tenant)


def test_it_hands_out_pages_in_order_and_never_the_scratch_page() -> None:
    pool = make_pool()
    assert pool.alloc(3, request_id=1) == [1, 2, 3]
    assert SCRATCH_PAGE not in pool.free_list()
    assert pool.free_pages == 5


def test_it_gives_the_last_freed_pages_back_first_in_their_order() -> None:
    pool = make_pool()
    a = pool.alloc(3, request_id=1)
    pool.alloc(2, request_id=2)
    pool.free([a[2], a[0], a[1]])
    assert pool.free_list()[:3] == [a[2], a[0], a[1]]
    assert pool.alloc(3, request_id=3) == [a[2], a[0], a[1]]


def test_it_gives_request_a_pages_to_b_in_a_order() -> None:
    pool = make_pool()
    a = pool.alloc(4, request_id=1)
    pool.free(a)
    assert pool.alloc(4, request_id=2) == a


def test_it_keeps_data_of_freed_pages_without_zeroing() -> None:
    pool = make_pool()
    a = pool.alloc(2, request_id=1)
    write(pool, a, 8, request_id=1)
    pool.free(a)
    assert torch.all(pool.k[a] == 1.0)
    assert pool.owner_request[a].tolist() == [1, 1]


def test_it_zeroes_freed_pages_and_clears_their_tags_when_asked() -> None:
    pool = make_pool(zero_freed_pages=True)
    a = pool.alloc(2, request_id=1)
    write(pool, a, 8, request_id=1, tenant=3)
    pool.free(a)
    assert torch.all(pool.k[a] == 0) and torch.all(pool.v[a] == 0)
    assert pool.owner_request[a].tolist() == [0, 0]
    assert pool.owner_tenant[a].tolist() == [0, 0]
    assert pool.filled[a].tolist() == [0, 0]


def test_it_tags_pages_on_write_not_on_allocation() -> None:
    pool = make_pool()
    pages = pool.alloc(3, request_id=7)
    assert pool.owner_request[pages].tolist() == [0, 0, 0]
    write(pool, pages, 6, request_id=7, tenant=2)
    assert pool.owner_request[pages].tolist() == [7, 7, 0]
    assert pool.owner_tenant[pages].tolist() == [2, 2, 0]
    assert pool.filled[pages].tolist() == [4, 2, 0]


def test_it_grows_filled_as_the_owner_appends() -> None:
    pool = make_pool()
    pages = pool.alloc(1, request_id=5)
    write(pool, pages, 2, request_id=5)
    index = torch.tensor(pages)
    pool.record_write(index, torch.tensor([2]), torch.tensor([3]), request_id=5, tenant_index=1)
    assert pool.filled[pages].tolist() == [3]


def test_it_restarts_filled_when_another_request_writes_the_page() -> None:
    pool = make_pool()
    pages = pool.alloc(1, request_id=1)
    write(pool, pages, 4, request_id=1)
    index = torch.tensor(pages)
    pool.record_write(index, torch.tensor([0]), torch.tensor([1]), request_id=2, tenant_index=2)
    assert (pool.owner_request[pages].tolist(), pool.filled[pages].tolist()) == ([2], [1])
    pool.record_write(index, torch.tensor([3]), torch.tensor([4]), request_id=3, tenant_index=3)
    assert (pool.owner_request[pages].tolist(), pool.filled[pages].tolist()) == ([3], [0])


def test_it_counts_pages_allocated_and_reused_dirty() -> None:
    pool = make_pool()
    a = pool.alloc(3, request_id=1)
    write(pool, a[:2], 8, request_id=1)
    pool.free(a)
    pool.alloc(3, request_id=2)
    assert pool.pages_allocated == 6
    assert pool.pages_reused_dirty == 2  # the third page was never written


def test_it_counts_no_dirty_reuse_when_freed_pages_are_zeroed() -> None:
    pool = make_pool(zero_freed_pages=True)
    a = pool.alloc(2, request_id=1)
    write(pool, a, 8, request_id=1)
    pool.free(a)
    pool.alloc(2, request_id=2)
    assert pool.pages_reused_dirty == 0
