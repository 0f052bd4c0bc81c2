"""The prefix cache inside the engine: who shares with whom, what a hit saves, and that shared pages
stay owner-verified.

The corruption tests break the cache or the allocator on purpose (a write landing in a cached page, a
stale or wrong entry, a page in use put back on the free list) and check that verification refuses
the reader before it reads, as it does for exclusive pages in ``test_engine.py``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch

from kvcanary.workers.engine import Engine
from kvcanary.workers.request import OWNERSHIP_VIOLATION, FinishEvent, TokenEvent
from tests.workers.support import Collector, run_until_idle, small_config, submit

# 100 bytes: six full pages of 16 and a partial one. The first request of a prefix computes them all.
PROMPT = (
    "tenant A's system prompt: you are the vault; the code is 0451-ALPHA; never say it. 0123456789abcdefg"
)
assert len(PROMPT) == 100
MODES = pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
PATHS = pytest.mark.parametrize("fast", [True, False], ids=["cpu-paths", "gpu-paths"])


def engine(**overrides: Any) -> Engine:
    fast = overrides.pop("fast", True)
    return Engine(small_config(**{"prefix_cache": "shared", **overrides}), cpu_fast_paths=fast)


def run(e: Engine, text: str, tenant: str = "tenant-a", max_tokens: int = 200, **options: Any) -> Collector:
    collector = submit(e, text, max_tokens, tenant, **options)
    run_until_idle(e)
    return collector


def cached(collector: Collector) -> int | None:
    finish = collector.last
    assert isinstance(finish, FinishEvent), finish
    return finish.cached_tokens


def sample(e: Engine, name: str) -> float | None:
    return e.metrics.registry.get_sample_value(name)


@MODES
def test_it_serves_whole_cached_pages_to_the_next_request_of_a_tenant(mode: str) -> None:
    e = engine(mode=mode, prefix_cache="per-tenant", verify_ownership=True)
    first, again = run(e, PROMPT), run(e, PROMPT)
    assert (cached(first), cached(again)) == (0, 96)  # six whole pages; the partial one is recomputed
    assert first.text == again.text == PROMPT
    longer = run(e, PROMPT + " and more")
    assert cached(longer) == 96 and longer.text == PROMPT + " and more"
    assert cached(run(e, PROMPT[:96])) == 80  # 96 tokens: the sixth page is recomputed, not hit
    assert sample(e, "kvcanary_kv_ownership_violations_total") == 0


@pytest.mark.parametrize("salt", [None, "one-salt-for-both"])
@pytest.mark.parametrize(("mode", "expected"), [("shared", 96), ("per-tenant", 0), ("off", None)])
def test_it_shares_pages_across_tenants_only_in_shared_mode(
    mode: str, expected: int | None, salt: str | None
) -> None:
    e = engine(prefix_cache=mode)
    run(e, PROMPT, tenant="tenant-a", cache_salt=salt)
    b = run(e, PROMPT, tenant="tenant-b", cache_salt=salt)  # per-tenant: the tenant salts on top
    assert cached(b) == expected
    assert b.text == PROMPT


@pytest.mark.parametrize("mode", ["shared", "per-tenant"])
@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [("s1", "s1", 96), ("s1", "s2", 0), (None, "s1", 0), ("s1", None, 0)],
)
def test_it_shares_only_between_requests_with_the_same_cache_salt(
    mode: str, first: str | None, second: str | None, expected: int
) -> None:
    e = engine(prefix_cache=mode)
    run(e, PROMPT, cache_salt=first)
    assert cached(run(e, PROMPT, cache_salt=second)) == expected


@MODES
def test_it_skips_the_prefill_of_cached_pages_and_answers_sooner(mode: str) -> None:
    pools = {"kv_pool_tokens": 8192, "prefill_pool_tokens": 8192, "decode_pool_tokens": 8192}
    e = engine(mode=mode, **pools)
    computed: list[int] = []
    prefill = e.model.prefill

    def spy(pool: Any, pages: list[int], token_ids: list[int], **kwargs: Any) -> None:
        computed.append(len(token_ids) - kwargs.get("start", 0))
        prefill(pool, pages, token_ids, **kwargs)

    e.model.prefill = spy  # type: ignore[method-assign]

    def time_to_first_token(prompt: list[int]) -> float:
        """The CPU this process spent until the first token: the engine's work, all its threads,
        and none of the time another process held the cores (a wall clock on a 2-core machine
        running two test suites measured their turns: a median ratio of 0.68 where the work's is
        under 0.3)."""
        seen: list[float] = []

        def emit(event: Any) -> None:
            if isinstance(event, TokenEvent) and not seen:
                seen.append(time.process_time())

        started = time.process_time()
        e.submit(prompt, 1, tenant="t", emit=emit)
        run_until_idle(e)
        return seen[0] - started

    ratios = []
    for i in range(11):  # pairs: a miss, then the same prompt again; the load on the machine hits both
        prompt = [(i * 7 + j * 13) % 251 + 1 for j in range(6000)]
        miss = time_to_first_token(prompt)
        ratios.append(time_to_first_token(prompt) / miss)
    assert computed[:2] == [6000, 16]  # 6000 = 375 pages: 374 hit, the last page recomputed
    # A miss prefills 6000 positions; a hit hashes the prompt and prefills 16, then both decode over
    # all 6000: about a quarter of the CPU time (medians 0.26 measured, beside a full test run). In
    # disaggregated mode both also transfer all 6000 positions to decode pages (median 0.44).
    assert statistics.median(ratios) < (0.6 if mode == "aggregated" else 0.8), ratios


@PATHS
def test_it_lets_requests_read_legitimately_shared_pages_under_verification(fast: bool) -> None:
    e = engine(verify_ownership=True, max_batch=8, fast=fast)
    collectors = [submit(e, PROMPT + f" #{i}", 200, f"tenant-{i % 3}") for i in range(6)]
    run_until_idle(e)  # the first one publishes; the next five join the same step, reading its pages
    assert [c.text for c in collectors] == [PROMPT + f" #{i}" for i in range(6)]
    assert [cached(c) for c in collectors] == [0] + [96] * 5
    assert e.largest_batch == 6
    assert sample(e, "kvcanary_kv_ownership_violations_total") == 0
    assert sample(e, "kvcanary_kv_ownership_checks_total") > 0  # type: ignore[operator]


def test_it_never_lets_a_page_with_users_reach_the_free_list_under_pressure() -> None:
    e = engine(kv_pool_tokens=512, max_batch=6, verify_ownership=True)
    cache, pool = e.prompt_pages, e.decode_pool
    prompts = [f"<{i % 7}>" + PROMPT[: 40 + 17 * (i % 4)] for i in range(24)]  # 7 heads, 4 lengths
    collectors = [submit(e, prompt, 60, f"t{i % 2}") for i, prompt in enumerate(prompts)]
    while e.batch or e._waiting:
        e.admit_waiting()
        in_use = {page for request in e.batch.requests for page in request.pages}
        assert not in_use & set(pool.free_list())
        for page in in_use:
            entry = cache.entry(page)
            assert entry is None or entry.refs >= 1
        if e.batch:
            e.decode_once()
    assert [c.text for c in collectors] == [p[:60] for p in prompts]
    assert cache.evictions > 0 and sum(cached(c) or 0 for c in collectors) > 0
    assert pool.free_pages + cache.evictable_pages == pool.num_pages
    assert sample(e, "kvcanary_kv_ownership_violations_total") == 0


@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero-freed"])
def test_it_evicts_cached_pages_when_the_pool_runs_short(zero: bool) -> None:
    e = engine(kv_pool_tokens=256, zero_freed_pages=zero)  # 16 pages
    a = run(e, PROMPT, max_tokens=16)  # 116 tokens: 8 pages, six of them published
    assert e.prompt_pages.cached_pages == 6
    b = run(e, "b" * 240, max_tokens=16)  # 16 pages: the 10 free ones, then A's 6 evicted
    assert b.text == "b" * 16 and e.prompt_pages.evictions == 6
    again = run(e, PROMPT, max_tokens=16)
    assert cached(again) == 0 and again.text == a.text == PROMPT[:16]
    dirty = sample(e, "kvcanary_kv_pages_reused_dirty_total")
    assert dirty == 0 if zero else dirty > 0  # type: ignore[operator]


def publish_then_corrupt(e: Engine, corrupt: str) -> Collector | None:
    """Publish A's prompt, then break the cache as ``corrupt`` says; return A's collector if A still runs.

    ``foreign-write``: another request writes into one of A's cached pages. ``stale-entry``: A's first
    entry names a page the cache never published (a page deep in the free list). ``held``: while A
    runs, its first entry names a page A holds as its own.
    """
    cache = e.prompt_pages
    a = submit(e, PROMPT, 200, "tenant-a")
    e.admit_waiting()
    pages = e.batch.requests[0].pages
    entry = cache.entry(pages[0])
    assert entry is not None
    if corrupt == "held":
        entry.page = pages[-1]
        return a
    run_until_idle(e)
    if corrupt == "foreign-write":
        page, start, end = torch.tensor(pages[2:3]), torch.tensor([0]), torch.tensor([16])
        e.decode_pool.record_write(page, start, end, request_id=99, tenant_index=9)
    else:
        stale = e.decode_pool.free_list()[-1]
        del cache._by_page[entry.page]
        entry.page = stale
        cache._by_page[stale] = entry
    return None


@PATHS
@pytest.mark.parametrize("corrupt", ["foreign-write", "stale-entry", "held"])
def test_it_refuses_a_cached_page_that_is_not_what_the_cache_published(corrupt: str, fast: bool) -> None:
    e = engine(verify_ownership=True, fast=fast)
    a = publish_then_corrupt(e, corrupt)
    b = run(e, PROMPT, tenant="tenant-b")
    assert b.events == [OWNERSHIP_VIOLATION]  # before any token was read
    assert sample(e, "kvcanary_kv_ownership_violations_total") == 1
    if a is not None:
        assert a.text == PROMPT  # refused before it could touch A's page


def test_it_refuses_a_page_in_use_that_the_allocator_hands_out_again() -> None:
    e = engine(verify_ownership=True)
    a = submit(e, PROMPT, 200, "tenant-a")
    e.admit_waiting()
    shared_page = e.batch.requests[0].pages[0]  # published: the cache owns it, A reads it
    e.decode_pool._free_stack.append(shared_page)  # an allocator bug: a page in use is free
    b = run(e, "b" * 40, tenant="tenant-b")
    assert b.events == [OWNERSHIP_VIOLATION]
    assert a.text == PROMPT
    assert e.prompt_pages.entry(shared_page).refs == 0  # type: ignore[union-attr]


def test_it_refuses_to_transfer_a_cached_prefill_page_that_another_request_wrote() -> None:
    e = engine(mode="disaggregated", verify_ownership=True)
    run(e, PROMPT)
    cache = e.prompt_pages
    keys = cache.page_keys(list(PROMPT.encode()), tenant="any", cache_salt=None)
    prefill_pages = [entry.page for entry in cache.match(keys, len(keys))]
    page, start, end = torch.tensor(prefill_pages[1:2]), torch.tensor([0]), torch.tensor([16])
    e.pools["prefill"].record_write(page, start, end, request_id=99, tenant_index=9)
    b = run(e, PROMPT, tenant="tenant-b")
    assert b.events == [OWNERSHIP_VIOLATION]
    assert sample(e, "kvcanary_kv_ownership_violations_total") == 1
    assert e.decode_pool.free_pages == e.decode_pool.num_pages
    assert [cache.entry(p).refs for p in prefill_pages] == [0] * 6  # type: ignore[union-attr]
