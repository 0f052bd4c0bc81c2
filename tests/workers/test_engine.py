"""The engine without HTTP: continuous batching, aborts, and what owner verification catches.

The corruption tests break the engine on purpose, the way the related failures did (a block table
pointing at another request's pages, SGLang #34208; a late write landing in pages a request reads,
SGLang #24527), and check that verification refuses the read while the unverified engine leaks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcanary.workers.engine import Engine
from kvcanary.workers.kv_cache import PagePool
from kvcanary.workers.model import DecodeStep
from kvcanary.workers.request import OWNERSHIP_VIOLATION, Event, FinishEvent
from tests.workers.support import Collector, run_until_idle, small_config, submit

SECRET = "tenant A's secret: the vault code is 0451-ALPHA. " * 4


def violations(engine: Engine) -> float | None:
    return engine.metrics.registry.get_sample_value("kvcanary_kv_ownership_violations_total")


# The GPU's verification paths (branch-free check, expected words raised by put_) run on the CPU too.
PATHS = pytest.mark.parametrize("fast", [True, False], ids=["cpu-paths", "gpu-paths"])


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"verify_ownership": True},
        {"verify_ownership": True, "fast": False},
        {"zero_freed_pages": True},
    ],
    ids=["plain", "verified", "verified-gpu-paths", "zero-freed"],
)
def test_it_decodes_many_tenants_in_one_batch_each_with_its_own_echo(flags: dict[str, bool]) -> None:
    flags = dict(flags)
    fast = flags.pop("fast", True)
    engine = Engine(small_config(max_batch=8, **flags), cpu_fast_paths=fast)
    prompts = {f"tenant-{i}": f"tenant {i} says: " + chr(65 + i) * (20 + 7 * i) for i in range(6)}
    collectors = {tenant: submit(engine, prompt, 500, tenant) for tenant, prompt in prompts.items()}
    run_until_idle(engine)
    assert engine.largest_batch == 6
    assert {tenant: c.text for tenant, c in collectors.items()} == prompts
    assert all(isinstance(c.last, FinishEvent) and c.last.reason == "stop" for c in collectors.values())


def test_it_queues_requests_until_pages_free_up() -> None:
    engine = Engine(small_config(kv_pool_tokens=256, max_batch=8))
    collectors = [submit(engine, chr(97 + i) * 100, 100, f"t{i}") for i in range(3)]  # 200 tokens each
    engine.admit_waiting()
    assert len(engine.batch) == 1 and len(engine._waiting) == 2
    run_until_idle(engine)
    assert [c.text for c in collectors] == [chr(97 + i) * 100 for i in range(3)]


def test_it_frees_the_pages_of_an_aborted_request() -> None:
    engine = Engine(small_config())
    pool = engine.decode_pool
    collector = submit(engine, "x" * 300, 300, "t")
    engine.admit_waiting()
    engine.decode_once()
    engine.abort(engine.batch.requests[0])
    engine.decode_once()
    assert len(engine.batch) == 0
    assert pool.free_pages == pool.num_pages
    assert len(collector.events) == 1  # no event after the abort


def point_b_at_a_pages(engine: Engine) -> tuple[Collector, Collector]:
    """Admit A and B, then corrupt B's block table to A's pages (a double-allocation bug)."""
    a = submit(engine, SECRET, 200, "tenant-a")
    b = submit(engine, "b" * len(SECRET), 200, "tenant-b")
    engine.admit_waiting()
    pages_a = engine.batch.requests[0].pages
    engine.batch.table[1, : len(pages_a)] = torch.tensor(pages_a)
    return a, b


@PATHS
def test_it_refuses_a_block_table_pointing_at_another_request_pages(fast: bool) -> None:
    engine = Engine(small_config(verify_ownership=True), cpu_fast_paths=fast)
    a, b = point_b_at_a_pages(engine)
    run_until_idle(engine)
    assert b.events == [OWNERSHIP_VIOLATION]
    assert a.text == SECRET[:200]
    assert violations(engine) == 1


def test_it_leaks_through_the_same_corruption_without_verification() -> None:
    engine = Engine(small_config())
    _, b = point_b_at_a_pages(engine)
    run_until_idle(engine)
    assert "0451-ALPHA" in b.text


@PATHS
def test_it_never_gathers_the_foreign_pages_it_refuses(fast: bool) -> None:
    engine = Engine(small_config(verify_ownership=True), cpu_fast_paths=fast)
    gathered: list[torch.Tensor] = []
    attend = engine.model.attend

    def spy(pool: object, tables: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        gathered.append(tables.clone())
        return attend(pool, tables, *args)  # type: ignore[arg-type]

    engine.model.attend = spy  # type: ignore[method-assign]
    point_b_at_a_pages(engine)
    pages_a = set(engine.batch.requests[0].pages)
    engine.decode_once()
    assert gathered and not pages_a & set(gathered[0][1].tolist())


@PATHS
def test_it_refuses_to_read_a_page_after_a_late_foreign_write(fast: bool) -> None:
    engine = Engine(small_config(verify_ownership=True), cpu_fast_paths=fast)
    a = submit(engine, SECRET, 200, "tenant-a")
    engine.admit_waiting()
    engine.decode_once()
    late_page = torch.tensor([engine.batch.requests[0].pages[2]])
    engine.decode_pool.record_write(
        late_page, torch.tensor([0]), torch.tensor([16]), request_id=99, tenant_index=9
    )
    engine.decode_once()
    assert a.events[-1] == OWNERSHIP_VIOLATION
    assert a.text == SECRET[:1]


@PATHS
@pytest.mark.parametrize("writer", ["earlier", "later"])
def test_it_refuses_a_page_allocated_ahead_that_another_request_wrote(writer: str, fast: bool) -> None:
    engine = Engine(small_config(verify_ownership=True), cpu_fast_paths=fast)
    longer = submit(engine, "L" * 60, 4, "tenant-x")  # spans 4 pages, so every row's step shows 4
    a = submit(engine, "x" * 20, 20, "tenant-a")  # reserves 3 pages; page 2 is first written at 32
    engine.admit_waiting()
    other_id = engine.batch.requests[0].request_id if writer == "earlier" else 99
    ahead = torch.tensor(engine.batch.requests[1].pages[2:3])
    engine.decode_pool.record_write(
        ahead, torch.tensor([0]), torch.tensor([1]), request_id=other_id, tenant_index=9
    )
    run_until_idle(engine)
    assert a.events == [OWNERSHIP_VIOLATION]  # in the first step, before anything was emitted
    assert longer.text == "LLLL"


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_it_refuses_a_page_handed_out_twice_before_writing_into_it(mode: str) -> None:
    engine = Engine(small_config(verify_ownership=True, mode=mode))
    pool = engine.decode_pool
    a = submit(engine, SECRET, 200, "tenant-a")
    engine.admit_waiting()
    pool._free_stack.append(engine.batch.requests[0].pages[-1])  # an allocator bug: a held page is free
    b = submit(engine, "b" * 40, 40, "tenant-b")
    run_until_idle(engine)
    assert b.events == [OWNERSHIP_VIOLATION]
    assert a.text == SECRET[:200]  # B never wrote into A's page
    assert violations(engine) == 1
    assert sorted(pool.free_list()) == list(range(1, pool.num_pages + 1))  # each page free exactly once


def test_it_refuses_a_request_given_the_same_page_twice() -> None:
    engine = Engine(small_config(verify_ownership=True))
    pool = engine.decode_pool
    pool._free_stack.append(pool._free_stack[-1])  # an allocator bug: the front page is listed twice
    b = submit(engine, "b" * 40, 40, "tenant-b")
    run_until_idle(engine)
    assert b.events == [OWNERSHIP_VIOLATION]
    assert violations(engine) == 1
    assert sorted(pool.free_list()) == list(range(1, pool.num_pages + 1))


def lose_one_write(engine: Engine, step_index: int) -> None:
    """Send the newest token's K/V (and its tag) of decode step ``step_index`` to the wrong page."""
    write_newest, calls = engine.model.write_newest, itertools.count()

    def misdirected(pool: PagePool, step: DecodeStep) -> None:
        if next(calls) == step_index:
            step.write_pages = step.write_pages + 1  # an off-by-one page: this request's next page
        write_newest(pool, step)

    engine.model.write_newest = misdirected  # type: ignore[method-assign]


@PATHS
def test_it_refuses_to_read_a_slot_its_request_never_wrote(fast: bool) -> None:
    engine = Engine(small_config(verify_ownership=True), cpu_fast_paths=fast)
    lose_one_write(engine, step_index=3)
    a = submit(engine, "x" * 20, 20, "tenant-a")  # step 3 writes position 22: page 1, slot 6
    run_until_idle(engine)
    assert a.events[-1] == OWNERSHIP_VIOLATION  # refused in step 3, before reading slot 6
    assert a.text == "x" * 3


def test_it_aborts_a_request_whose_submitter_is_gone_and_keeps_serving() -> None:
    engine = Engine(small_config())

    def gone(event: Event) -> None:
        raise RuntimeError("Event loop is closed")

    engine.submit(list(b"nobody listens"), 50, tenant="t", emit=gone)
    healthy = submit(engine, "still served", 50, "u")
    run_until_idle(engine)
    assert healthy.text == "still served"
    assert engine.decode_pool.free_pages == engine.decode_pool.num_pages
