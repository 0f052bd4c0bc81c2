"""The traffic judge on the event loop: a batch is judged a slice of time at a time, the loop's other
work (probes' timing, pulls, leases, health) running between slices, one slice at a time however
many deployments judge at once, and the slices judge as one pass would."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic import judge as judge_module
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.schema import MAX_FINGERPRINTS, MAX_TOKENS
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize

FP = Fingerprinter(b"a-test-fingerprint-key-0123456789")
BASE = "http://127.0.0.1:9/v1"
WORDS = Path("/usr/share/common-licenses/GPL-3").read_text().split()


class Target:
    """A target's facts as the judge asks for them: calibrated, a pool far above any prompt."""

    calibration = TokenCalibration()
    calibration.note(1000, 250)

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        return ServerCapacity(kv_pool_tokens=1_000_000)


def new_judge() -> TrafficJudge:
    settings = Settings.model_validate(
        {"targets": [{"name": "t", "base_url": BASE, "tenants": [{"name": "a"}, {"name": "b"}]}]}
    )
    return TrafficJudge(settings, {"t": Target()}, MarkerBook(), MonitorMetrics(CollectorRegistry()))


def record(i: int, caller: str, response: str, prompt: str | None = None) -> TrafficRecord:
    if prompt is None:
        prompt = "question {}: {}".format(i, " ".join(WORDS[(i * 37) % 4000 : (i * 37) % 4000 + 60]))
    exchange = Exchange(f"r{i}", 1.8e9 + i, caller, "team", BASE, prompt=prompt, response=response)
    return TrafficRecord.model_validate(summarize(exchange, FP))


def batch(n: int) -> list[TrafficRecord]:
    """``n`` benign records of eight callers, each answer its own text; the last one an answer
    carrying the first caller's private prompt to another caller (a leak the window must still hold)."""
    own = [" ".join(f"w{i}x{j}" for j in range(120)) for i in range(n)]
    private = " ".join(f"p0x{j}" for j in range(120))
    first = record(0, "c0", own[0], prompt=private)
    records = [first, *(record(i, f"c{i % 8}", own[i]) for i in range(1, n - 1))]
    return [*records, record(n - 1, "c1", "Here it is: " + private)]


class CountedTurn(asyncio.Lock):
    """The judge's turn, noting each slice taken in ``events`` beside the ticker's turns."""

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    async def acquire(self) -> bool:
        taken = await super().acquire()
        self.events.append("slice")
        return taken


@dataclass
class Ticked:
    """What a ticker beside the judge saw: records flagged, the CPU time the judging took, the loop
    thread's CPU time between the ticker's turns, and the most slices between two of its turns."""

    flagged: int
    took: float
    gaps: list[float]
    most_slices_a_turn: int


def judged_beside_a_ticker(judge: TrafficJudge, batches: list[list[TrafficRecord]]) -> Ticked:
    """Judge ``batches`` at once beside a task that takes every turn of the loop it can."""
    gaps: list[float] = []
    events: list[str] = []
    judge._turn = CountedTurn(events)

    async def run() -> tuple[int, float]:
        done = asyncio.Event()

        # CPU time of the loop's thread: a machine that takes the process off its core for a
        # while (a loaded CI run) stretches no gap.
        async def tick() -> None:
            last = time.thread_time()
            while not done.is_set():
                await asyncio.sleep(0)
                now = time.thread_time()
                gaps.append(now - last)
                events.append("tick")
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        began = time.thread_time()
        judged = await asyncio.gather(*(judge.judge(records, "gw") for records in batches))
        took = time.thread_time() - began
        done.set()
        await ticker
        return sum(j.flagged for j in judged), took

    # The collector off: a full collection lands in whichever gap allocates past its threshold and
    # lasts as long as the whole process's heap makes it (0.07 s in a bare process, 0.35 s in an
    # xdist worker after hundreds of tests). That is the process's pause, not the judge's slicing.
    gc.collect()
    gc.disable()
    try:
        flagged, took = asyncio.run(run())
    finally:
        gc.enable()
    runs = "".join("s" if e == "slice" else "." for e in events).split(".")
    return Ticked(flagged, took, gaps, max(map(len, runs)))


def test_a_large_batch_leaves_the_loop_free_between_slices_and_judges_as_one_pass() -> None:
    ticked = judged_beside_a_ticker(new_judge(), [batch(2000)])
    assert ticked.flagged == 1  # the leak in the last slice, of what the first slice's caller asked
    assert ticked.most_slices_a_turn == 1  # the loop ran between every two slices
    # A slice's CPU time is at most its SLICE_SECONDS of wall time and a record's.
    assert len(ticked.gaps) >= ticked.took / (2 * judge_module.SLICE_SECONDS), (len(ticked.gaps), ticked.took)
    # No stall near the whole batch's time: about one slice's (a loaded machine stretches both).
    assert max(ticked.gaps) < ticked.took / 4, (max(ticked.gaps), ticked.took)


def largest(i: int, api_base: str, caller: str) -> TrafficRecord:
    """A record with every print a side allows, random ones (nobody else's), to ``api_base``."""
    rng = random.Random(i)
    prints = {side: [rng.getrandbits(51) for _ in range(MAX_FINGERPRINTS)] for side in ("prompt", "response")}
    tokens = {side: [rng.getrandbits(51) | 1 for _ in range(MAX_TOKENS)] for side in ("prompt", "response")}
    return TrafficRecord.model_validate({
        "id": f"r-{i}", "time": 1.8e9 + i, "caller": caller, "api_base": api_base,
        "status": 200, "fingerprints": prints, "distinctive": tokens,
    })  # fmt: skip


def test_batches_of_the_largest_records_for_several_deployments_take_one_slice_at_a_time() -> None:
    """Four deployments' batches judged at once: the loop's other work waits for one slice between
    its turns, not for one slice of each batch, and a slice ends soon after its time."""
    bases = [f"http://10.3.0.{t}:8000/v1" for t in range(4)]
    targets = [{"name": f"t{t}", "base_url": base, "tenants": [{"name": "a"}, {"name": "b"}]}
               for t, base in enumerate(bases)]  # fmt: skip
    settings = Settings.model_validate({"targets": targets})
    judge = TrafficJudge(settings, {}, MarkerBook(), MonitorMetrics(CollectorRegistry()))
    ticked = judged_beside_a_ticker(
        judge, [[largest(i, base, f"c{i % 8}") for i in range(40)] for base in bases]
    )
    assert ticked.flagged == 0
    assert ticked.most_slices_a_turn == 1
    # A slice is SLICE_SECONDS and the record that passes it (about 1 ms of CPU on an idle machine):
    # far from the 160 records' time, a stall of the whole of which the loop saw before.
    assert max(ticked.gaps) < min(ticked.took / 4, 0.05), (max(ticked.gaps), ticked.took)


def test_a_window_full_after_an_idle_spell_expires_in_slices() -> None:
    clock = [0.0]
    judge = new_judge()
    judge.clock = lambda: clock[0]
    asyncio.run(judge.judge([largest(i, BASE, f"c{i % 8}") for i in range(100)], "gw"))
    assert judge._deployment("t").window.held > 100_000
    clock[0] = judge.settings.traffic.overlap_window_seconds + 1  # all of it past the window now
    ticked = judged_beside_a_ticker(judge, [[largest(1000, BASE, "c9")]])
    assert judge._deployment("t").window.held == 2 * MAX_FINGERPRINTS  # the new exchange alone
    assert ticked.most_slices_a_turn == 1
    # Dropping a full window at once took about a third of a second on this machine.
    assert max(ticked.gaps) < min(ticked.took / 4, 0.05), (max(ticked.gaps), ticked.took)


def test_a_batch_waiting_through_a_reload_is_judged_against_the_window_the_reload_made() -> None:
    records = batch(1600)

    async def run() -> tuple[int, int]:
        judge = new_judge()
        first = asyncio.create_task(judge.judge(records[:1500], "gw"))  # many slices
        waiting = asyncio.create_task(judge.judge(records[1500:], "gw"))
        for _ in range(10):  # the first holds the deployment's lock; the second waits for it
            await asyncio.sleep(0)
        assert not first.done() and not waiting.done()
        changed = judge.settings.model_copy(
            update={"traffic": judge.settings.traffic.model_copy(update={"overlap_min_run": 9})}
        )
        judge.take_up(changed)  # the window's settings changed: every window starts anew
        await first
        judged = await waiting
        return judged.accepted, judge._deployment("t").window.held

    accepted, held = asyncio.run(run())
    assert accepted == 100 and held > 0  # judged, and into the window that is now the deployment's
