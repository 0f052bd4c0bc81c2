"""FairSlots: who gets the next free slot when more runs are due than slots exist."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kvcanary.monitor.runs.slots import FairSlots


def sync(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test on a fresh event loop."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def holder(
    slots: FairSlots, target: str, release: asyncio.Event, got: list[str], slow: bool = False
) -> None:
    async with slots.hold(target, slow):
        got.append(target)
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@sync
async def test_the_target_that_used_the_least_goes_first_however_many_others_queue() -> None:
    clock = Clock()
    slots = FairSlots(total=1, per_target=4, clock=clock)
    for _ in range(3):  # "slow" used the slot for 5 s three times; "fast" for 50 ms once
        async with slots.hold("slow"):
            clock.t += 5
    async with slots.hold("fast"):
        clock.t += 0.05
    release, got = asyncio.Event(), []
    first = asyncio.create_task(holder(slots, "slow", release, got))
    await settle()
    queued = [asyncio.create_task(holder(slots, "slow", release, got)) for _ in range(5)]
    queued.append(asyncio.create_task(holder(slots, "fast", release, got)))
    await settle()
    assert got == ["slow"] and slots.waiting == 6
    release.set()
    await asyncio.gather(first, *queued)
    assert got[1] == "fast"  # queued last, served first


@sync
async def test_no_target_holds_more_than_its_cap() -> None:
    slots = FairSlots(total=8, per_target=2)
    release, got = asyncio.Event(), []
    tasks = [asyncio.create_task(holder(slots, "a", release, got)) for _ in range(5)]
    tasks.append(asyncio.create_task(holder(slots, "b", release, got)))
    await settle()
    assert sorted(got) == ["a", "a", "b"] and slots.in_use == 3 and slots.waiting == 3
    release.set()
    await asyncio.gather(*tasks)
    assert got.count("a") == 5 and slots.in_use == 0


@sync
async def test_targets_known_to_hang_share_a_bounded_part_and_leave_the_rest_free() -> None:
    slots = FairSlots(total=4, per_target=4, slow_share=0.5)
    release, got = asyncio.Event(), []
    hung = [asyncio.create_task(holder(slots, f"h{i}", release, got, slow=True)) for i in range(10)]
    await settle()
    assert len(got) == 2  # half of four
    healthy = [asyncio.create_task(holder(slots, "ok", release, got)) for _ in range(2)]
    await settle()
    assert got.count("ok") == 2 and slots.in_use == 4
    release.set()
    await asyncio.gather(*hung, *healthy)
    assert len(got) == 12


@sync
async def test_a_cancelled_waiter_gives_its_place_and_its_slot_back() -> None:
    slots = FairSlots(total=1, per_target=1)
    release, got = asyncio.Event(), []
    first = asyncio.create_task(holder(slots, "a", release, got))
    await settle()
    waiting = asyncio.create_task(holder(slots, "b", release, got))
    later = asyncio.create_task(holder(slots, "c", release, got))
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    release.set()
    await asyncio.gather(first, later)
    assert got == ["a", "c"] and slots.in_use == 0 and slots.waiting == 0


@sync
async def test_a_run_past_its_lease_gives_its_slot_to_the_next_and_overtime_is_bounded() -> None:
    slots = FairSlots(total=1, per_target=4, overtime=1)
    release, got, leases = asyncio.Event(), [], []

    async def long_run(target: str) -> None:
        async with slots.hold(target) as lease:
            leases.append(lease)
            got.append(target)
            await release.wait()

    tasks = [asyncio.create_task(long_run(t)) for t in ("a", "b", "c")]
    await settle()
    assert got == ["a"]
    leases[0].overtime()  # "a" waits on without its slot: "b" gets it
    await settle()
    assert got == ["a", "b"] and slots.in_use == 1 and slots.in_overtime == 1
    leases[1].overtime()  # overtime is full: "b" keeps its slot, "c" waits
    await settle()
    assert got == ["a", "b"] and slots.in_overtime == 1
    release.set()
    await asyncio.gather(*tasks)
    assert got == ["a", "b", "c"] and slots.in_use == 0 and slots.in_overtime == 0


@sync
async def test_a_run_in_flight_counts_against_its_target_before_it_ends() -> None:
    """A target whose first run never ends must not look unused to the queue."""
    clock = Clock()
    slots = FairSlots(total=2, per_target=4, unknown_cost=5.0, clock=clock)
    release, got = asyncio.Event(), []
    stuck = asyncio.create_task(holder(slots, "hung", release, got))
    async with slots.hold("ok"):
        clock.t += 0.05
    await settle()
    clock.t += 30
    assert slots.usage("hung") == 5 + 30 and slots.usage("ok") < 0.1  # never finished: the prior, and 30 s
    release.set()
    await stuck


@sync
async def test_targets_never_seen_to_finish_queue_behind_one_known_to_be_quick() -> None:
    clock = Clock()
    slots = FairSlots(total=1, per_target=4, unknown_cost=5.0, clock=clock)
    async with slots.hold("quick"):
        clock.t += 0.01
    release, got = asyncio.Event(), []
    first = asyncio.create_task(holder(slots, "new-0", release, got))
    await settle()
    queued = [asyncio.create_task(holder(slots, f"new-{i}", release, got)) for i in range(1, 20)]
    queued.append(asyncio.create_task(holder(slots, "quick", release, got)))
    await settle()
    release.set()
    await asyncio.gather(first, *queued)
    assert got[:2] == ["new-0", "quick"]
