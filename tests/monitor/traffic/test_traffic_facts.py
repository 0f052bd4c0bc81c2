"""A target that does not answer never holds the traffic judge up: a batch waits a bounded time
for a node's pool or a token count, and the reading goes on, once, for the batches after it.

The target is a real client (``OpenAIHttpTarget``) of an engine on loopback that holds every
request until the test lets it answer."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx

from kvcanary.monitor.traffic.facts import POOL_SECONDS, UNANSWERED_POOL_SECONDS, TargetFacts
from tests.probes.probe_harness import FakeEngine


@dataclass
class HeldEngine(FakeEngine):
    """The reference engine, answering nothing until ``released`` is set."""

    released: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        while not self.released.is_set():
            await asyncio.sleep(0.02)
        return await super().__call__(request)


def test_a_hung_target_costs_a_batch_a_bounded_wait_and_is_read_once() -> None:
    engine = HeldEngine()

    async def run() -> None:
        client = engine.target()
        known = TargetFacts({"t": client}, wait_seconds=0.2)
        try:
            started = time.monotonic()
            # Five batches at once; bounded here so that a judge that waits on the target fails, not hangs.
            pools = await asyncio.wait_for(asyncio.gather(*(known.pool("t", "") for _ in range(5))), 5)
            assert pools == [None] * 5
            assert await known.chars_per_token("t") is None
            assert time.monotonic() - started < 2  # not the target's timeout: 0.2 s a wait
            engine.released.set()  # the engine answers: the readings that went on land
            for _ in range(100):
                if engine.info_reads and client.calibration.chars_per_token is not None:
                    break
                await asyncio.sleep(0.05)
            assert await known.pool("t", "") == 1024  # REFERENCE_INFO's smallest pool
            assert engine.info_reads == 1  # one reading, however many batches asked
            assert await known.chars_per_token("t") is not None
        finally:
            engine.released.set()
            await client.aclose()

    asyncio.run(run())


@dataclass
class FlakyEngine(FakeEngine):
    """The reference engine, whose server info answers 503 while ``down`` is set."""

    down: bool = True

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down and request.url.path in ("/get_server_info", "/server_info"):
            self.info_reads += 1
            return httpx.Response(503, json={"error": "busy"})
        return await super().__call__(request)


def test_an_unanswered_pool_lookup_is_asked_again_soon_and_never_unsays_a_known_pool() -> None:
    """A first reading missed on a loaded node left a guarded deployment unguarded for a minute
    (the no-pool reading kept as if the engine published none); and a node that stopped answering
    for a moment lost the pool it had."""
    engine = FlakyEngine()
    now = [1000.0]

    async def run() -> None:
        client = engine.target()
        known = TargetFacts({"t": client}, clock=lambda: now[0], wait_seconds=5)
        try:
            assert await known.pool("t", "") is None  # 503: not read
            engine.down = False
            now[0] += UNANSWERED_POOL_SECONDS + 1  # well within UNKNOWN_POOL_SECONDS
            assert await known.pool("t", "") == 1024
            engine.down = True
            now[0] += POOL_SECONDS + 1  # due again, and unanswered: the pool it had stands
            client.forget_capacity()  # the client's own reading as old (it keeps it POOL_SECONDS too)
            reads = engine.info_reads
            assert await known.pool("t", "") == 1024 and engine.info_reads > reads
            reads = engine.info_reads
            assert await known.pool("t", "") == 1024 and engine.info_reads == reads  # not asked at once
            now[0] += UNANSWERED_POOL_SECONDS + 1
            await known.pool("t", "")
            assert engine.info_reads > reads  # asked again soon
        finally:
            await client.aclose()

    asyncio.run(run())
