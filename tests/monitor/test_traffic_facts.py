"""A target that does not answer never holds the traffic judge up: a batch waits a bounded time
for a node's pool or a token count, and the reading goes on, once, for the batches after it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from monitor.traffic import facts
from monitor.traffic.facts import TargetFacts
from probes.target import ServerCapacity


class Hanging:
    """A target client whose capacity and token counts wait until ``released`` is set."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.reads = 0
        self.calibration = type("Calibration", (), {"chars_per_token": None})()

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        self.reads += 1
        await self.released.wait()
        return ServerCapacity(kv_pool_tokens=4096)

    async def count_tokens(self, text: str) -> Any:
        await self.released.wait()
        self.calibration.chars_per_token = 4.0


def test_a_hung_target_costs_a_batch_a_bounded_wait_and_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(facts, "FACT_WAIT_SECONDS", 0.2)

    async def run() -> None:
        client = Hanging()
        known = TargetFacts({"t": client})
        started = time.monotonic()
        pools = await asyncio.gather(*(known.pool("t", "") for _ in range(5)))  # five batches at once
        assert pools == [None] * 5 and client.reads == 1  # one reading, however many ask
        assert await known.chars_per_token("t") is None
        assert time.monotonic() - started < 2  # not the target's timeout: 0.2 s a wait
        client.released.set()  # the target answers: the reading that went on lands
        await asyncio.sleep(0.05)
        assert await known.pool("t", "") == 4096 and client.reads == 1
        assert await known.chars_per_token("t") == 4.0

    asyncio.run(run())
