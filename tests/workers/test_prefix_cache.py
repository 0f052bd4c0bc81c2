"""PrefixCache on a bare PagePool: chained salted keys, hits, refcounts, eviction, ownership words."""

from __future__ import annotations

import pytest
import torch

from kvcanary.workers.kv_cache import PagePool
from kvcanary.workers.prefix_cache import PageLease, PrefixCache, page_digest, token_bytes

SIZE = 4


def make_cache(mode: str = "shared", num_pages: int = 8, zero_freed_pages: bool = False) -> PrefixCache:
    pool = PagePool(
        name="test",
        num_pages=num_pages,
        page_size=SIZE,
        head_dim=2,
        device="cpu",
        zero_freed_pages=zero_freed_pages,
    )
    return PrefixCache(pool, mode)


def lease_and_prefill(
    cache: PrefixCache,
    tokens: list[int],
    request_id: int,
    *,
    extra_pages: int = 0,
    tenant: str = "t",
    salt: str | None = None,
) -> PageLease:
    """Lease pages for ``tokens`` (plus ``extra_pages``), write what the cache did not serve, publish."""
    pool = cache.pool
    num_pages = pool.pages_for(len(tokens)) + extra_pages
    lease = cache.lease(tokens, num_pages, request_id=request_id, tenant=tenant, cache_salt=salt)
    start = lease.cached_tokens
    k = torch.full((len(tokens) - start, pool.head_dim), float(request_id))
    pool.write_prefix(lease.pages[lease.hit_pages :], k, k.clone(), request_id=request_id, tenant_index=1)
    cache.publish(lease)
    return lease


PROMPT = list(range(1, 13))  # three full pages


def test_it_keys_full_pages_only_each_digest_covering_the_whole_prefix() -> None:
    cache = make_cache()
    keys = cache.page_keys([*PROMPT, 99], tenant="t", cache_salt=None)
    assert len(keys) == 3
    assert [key.parent for key in keys[1:]] == [key.digest for key in keys[:2]]
    head_changed = cache.page_keys([0, *PROMPT[1:]], tenant="t", cache_salt=None)
    assert all(a.digest != b.digest for a, b in zip(keys, head_changed, strict=True))
    tail_changed = cache.page_keys([*PROMPT[:-1], 0], tenant="t", cache_salt=None)
    assert [k.digest for k in tail_changed[:2]] == [k.digest for k in keys[:2]]
    assert tail_changed[2].digest != keys[2].digest


@pytest.mark.parametrize("mode", ["shared", "per-tenant"])
def test_it_digests_each_page_as_page_digest_defines(mode: str) -> None:
    keys = make_cache(mode).page_keys(PROMPT, tenant="alice", cache_salt="s1")
    for index, key in enumerate(keys):
        assert key.digest == page_digest(key.parent, key.tokens, key.extra)
        assert key.tokens == token_bytes(PROMPT[index * SIZE : (index + 1) * SIZE])


def test_it_salts_the_first_page_with_cache_salt_and_every_page_with_the_tenant() -> None:
    shared, per_tenant = make_cache("shared"), make_cache("per-tenant")
    salted = shared.page_keys(PROMPT, tenant="alice", cache_salt="s1")
    assert salted[0].extra and not salted[1].extra and not salted[2].extra
    assert shared.page_keys(PROMPT, tenant="bob", cache_salt="s1") == salted  # shared ignores the tenant
    alice = per_tenant.page_keys(PROMPT, tenant="alice", cache_salt=None)
    bob = per_tenant.page_keys(PROMPT, tenant="bob", cache_salt=None)
    assert all(key.extra for key in alice)
    assert all(a.digest != b.digest for a, b in zip(alice, bob, strict=True))


def test_it_never_lets_a_tenant_name_pose_as_a_salt() -> None:
    as_salt = make_cache("shared").page_keys(PROMPT, tenant="t", cache_salt="X")
    as_tenant = make_cache("per-tenant").page_keys(PROMPT, tenant="X", cache_salt=None)
    assert as_salt[0].digest != as_tenant[0].digest


def test_it_hits_the_longest_cached_prefix_but_leaves_one_token_to_compute() -> None:
    cache = make_cache()
    first = lease_and_prefill(cache, PROMPT, 1)
    assert first.hit_pages == 0 and cache.cached_pages == 3
    cache.release(first.pages)
    again = lease_and_prefill(cache, PROMPT, 2)
    assert (again.hit_pages, again.cached_tokens) == (2, 8)  # the last page is recomputed
    assert again.pages[:2] == first.pages[:2] and again.pages[2] != first.pages[2]
    cache.release(again.pages)
    longer = lease_and_prefill(cache, [*PROMPT, 13], 3)
    assert longer.cached_tokens == 12


def test_it_requires_the_tokens_to_match_not_only_the_digest() -> None:
    cache = make_cache()
    cache.release(lease_and_prefill(cache, PROMPT, 1).pages)
    keys = cache.page_keys(PROMPT, tenant="t", cache_salt=None)
    forged = [keys[0]._replace(tokens=bytes(len(keys[0].tokens))), *keys[1:]]
    assert cache.match(keys, 3) != [] and cache.match(forged, 3) == []


def test_it_never_puts_a_page_that_has_users_on_the_free_list() -> None:
    cache = make_cache()
    pool = cache.pool
    first = lease_and_prefill(cache, [*PROMPT, 13], 1)
    second = lease_and_prefill(cache, [*PROMPT, 14], 2)
    shared = first.pages[:3]
    assert second.pages[:3] == shared
    assert [cache.entry(page).refs for page in shared] == [2, 2, 2]  # type: ignore[union-attr]
    cache.release(first.pages)
    assert not set(shared) & set(pool.free_list()) and cache.evictable_pages == 0
    cache.release(second.pages)
    assert not set(shared) & set(pool.free_list()) and cache.evictable_pages == 3
    assert pool.free_pages + cache.evictable_pages == pool.num_pages
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(shared[:1])


def test_it_evicts_least_recently_released_pages_tail_first_only_when_the_free_list_runs_short() -> None:
    cache = make_cache(num_pages=8)
    a = lease_and_prefill(cache, [*PROMPT, 13, 14, 15, 16], 1)  # four full pages, all published
    cache.release(a.pages)
    assert cache.alloc(4, request_id=2) != [] and cache.evictions == 0
    [page] = cache.alloc(1, request_id=3)
    assert (cache.evictions, page) == (1, a.pages[3])  # A's tail went first, and was reused at once
    keys = cache.page_keys([*PROMPT, 13, 14, 15, 16, 17], tenant="t", cache_salt=None)
    assert [entry.page for entry in cache.match(keys, 4)] == a.pages[:3]


def test_it_refuses_an_allocation_it_cannot_serve_without_evicting_anything() -> None:
    cache = make_cache(num_pages=4)
    lease = lease_and_prefill(cache, PROMPT, 1)  # three pages in use
    with pytest.raises(RuntimeError, match="2 pages asked"):
        cache.alloc(2, request_id=2)
    assert cache.cached_pages == 3 and cache.pool.free_pages == 1
    cache.release(lease.pages)


def test_it_counts_an_evicted_page_as_dirty_and_a_hit_as_neither_allocated_nor_dirty() -> None:
    cache = make_cache(num_pages=4)
    pool = cache.pool
    cache.release(lease_and_prefill(cache, PROMPT, 1).pages)
    hit = lease_and_prefill(cache, [*PROMPT, 13], 2)
    assert hit.hit_pages == 3
    assert (pool.pages_allocated, pool.pages_reused_dirty) == (3 + 1, 0)
    cache.release(hit.pages)
    cache.alloc(4, request_id=3)  # the freed page request 2 wrote, then three evicted cached pages
    assert cache.evictions == 3 and pool.pages_reused_dirty == 4


def test_it_keeps_cached_pages_whole_but_zeroes_evicted_ones_when_freed_pages_are_zeroed() -> None:
    cache = make_cache(num_pages=4, zero_freed_pages=True)
    pool = cache.pool
    lease = lease_and_prefill(cache, PROMPT, 1)
    cache.release(lease.pages)
    assert torch.all(pool.k[lease.pages] == 1.0)  # evictable, not freed: still servable
    cache.alloc(4, request_id=2)
    assert torch.all(pool.k[lease.pages] == 0) and pool.ownership[lease.pages].tolist() == [0, 0, 0]
    assert pool.pages_reused_dirty == 0


def test_it_gives_published_pages_words_that_name_the_cache_and_no_request() -> None:
    cache = make_cache()
    pool = cache.pool
    lease = lease_and_prefill(cache, [*PROMPT, 13], 7)
    words = [lease.shared[index] for index in range(3)]
    assert pool.ownership[lease.pages[:3]].tolist() == words
    assert len(set(words)) == 3
    assert all(owner < 0 for owner in pool.owner_request[lease.pages[:3]].tolist())
    assert pool.filled[lease.pages[:3]].tolist() == [SIZE] * 3
    assert pool.owner_request[lease.pages[3]].item() == 7  # the partial page stays the request's


def test_it_passes_pages_straight_through_to_the_pool_when_off() -> None:
    cache = make_cache("off")
    pool = cache.pool
    lease = lease_and_prefill(cache, PROMPT, 1)
    assert (lease.keys, lease.shared, cache.cached_pages) == ([], {}, 0)
    cache.release(lease.pages)
    assert pool.free_list()[:3] == lease.pages  # LIFO, as without a cache
    assert lease_and_prefill(cache, PROMPT, 2).hit_pages == 0
