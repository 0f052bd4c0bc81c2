"""Hung and slow targets cost their own probes only: `kvcanary serve` against engines on loopback.

Why: with one first-come semaphore shared by all, 40 targets whose engine answers after 120 s keep
five healthy targets from running for ~110 s.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import httpx

from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import FakeEngine
from tests.support.loopback import Loopback

HUNG, HEALTHY = 16, 2


class Hung:
    """An engine that takes requests and never answers, until released at the end of the test."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.requests = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        while not self.released.is_set():
            await asyncio.sleep(0.05)
        return httpx.Response(503)


def runs(monitor: Served, target: str) -> float:
    return monitor.value("kvcanary_probe_runs_total", target=target) or 0.0


def test_healthy_targets_keep_their_schedule_beside_many_hung_ones(
    served: Callable[[dict[str, Any]], Served],
) -> None:
    hung, healthy = Hung(), FakeEngine()
    hung_server, healthy_server = Loopback(hung), Loopback(healthy)
    every = {"interval_seconds": 1, "timeout_seconds": 2, "probes": ["canary"]}
    targets = [reference_target(f"hung-{i}", hung_server.url, **every) for i in range(HUNG)]
    targets += [reference_target(f"ok-{i}", healthy_server.url, **every) for i in range(HEALTHY)]
    monitor = served({"scheduler": {"max_concurrency": 4, "jitter_seconds": 0}, "targets": targets})
    try:
        monitor.start()
        monitor.wait_for("the hung targets to hold every slot", lambda: hung.requests >= 4)
        # Past the start, where every hung target's first run holds a slot until its lease ends
        # (16 x 2 s over 4 slots): what is measured is the steady state.
        threading.Event().wait(8)
        before = {f"ok-{i}": runs(monitor, f"ok-{i}") for i in range(HEALTHY)}
        window = 15.0
        threading.Event().wait(window)
        done = {name: runs(monitor, name) - before[name] for name in before}
        # Due once a second: a healthy target that waited for hung neighbours runs every 8 s or so
        # (two or three times here); each tick a loaded machine skips costs one run.
        assert all(n >= 0.4 * window for n in done.values()), (done, monitor.log()[-3000:])
        assert monitor.value("kvcanary_run_slots_in_use") <= 4
        assert "waited out its timeout; next runs get one timeout each" in monitor.log()
    finally:
        hung.released.set()
        monitor.stop()
        hung_server.close()
        healthy_server.close()
