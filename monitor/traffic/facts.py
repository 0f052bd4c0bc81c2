"""What the traffic judge needs to know of a target, asked of its client and kept a while.

- characters per token: the client's calibration (``monitor/targets/calibration.py``); while it
  has none, the judge's own count of the monitor's sample text, once per ``RECOUNT_SECONDS``;
- each node's smallest KV pool: the node's own capacity reading (``node_capacity``; the target's
  ``capacity`` for a target without named nodes), kept ``POOL_SECONDS``, and a reading that found
  no pool kept ``UNKNOWN_POOL_SECONDS`` so that a node that does not answer is not asked again
  for every batch.

A batch waits at most ``FACT_WAIT_SECONDS`` for either (a hung target read with its 30 s timeout
stalled every batch behind it, and the tap's 5 s post with them): past that it is judged with
what is known (the last reading, or none), and the reading goes on, once however many batches
ask, for the batches after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from kvcanary.monitor.targets.calibration import RECOUNT_SECONDS, SAMPLE_TEXT
from kvcanary.probes.target import ServerCapacity

POOL_SECONDS = 600.0
UNKNOWN_POOL_SECONDS = 60.0
FACT_WAIT_SECONDS = 2.5


def smallest_pool(reading: ServerCapacity) -> int | None:
    sizes = [n for n in (reading.kv_pool_tokens, *reading.pools.values()) if n]
    return min(sizes) if sizes else None


class TargetFacts:
    """Calibration and pools by target and node; ``clients`` are the targets' clients by name."""

    def __init__(
        self,
        clients: Mapping[str, Any],
        clock: Callable[[], float] = time.monotonic,
        wait_seconds: float = FACT_WAIT_SECONDS,
    ):
        self.clients = clients
        self.clock = clock
        #: How long a batch waits for a reading (``FACT_WAIT_SECONDS``).
        self.wait_seconds = wait_seconds
        self._counted: dict[str, float] = {}  # when the judge last counted SAMPLE_TEXT, by target
        self._pools: dict[tuple[str, str], tuple[float, int | None]] = {}
        self._reading: dict[tuple[str, str], asyncio.Task[int | None]] = {}

    def forget(self, target: str) -> None:
        """Drop what is kept of ``target`` (a reload gave it a new client)."""
        self._counted.pop(target, None)
        self.forget_pools(target)

    def forget_pools(self, target: str) -> None:
        """Drop the pools kept of ``target``: its configuration changed, they are read again."""
        self._pools = {k: v for k, v in self._pools.items() if k[0] != target}

    async def chars_per_token(self, target: str) -> float | None:
        client = self.clients.get(target)
        calibration = getattr(client, "calibration", None)
        if calibration is None:
            return None
        if calibration.chars_per_token is None:
            now = self.clock()
            if now - self._counted.get(target, float("-inf")) >= RECOUNT_SECONDS:
                self._counted[target] = now
                counting = _background(client.count_tokens(SAMPLE_TEXT))  # type: ignore[union-attr]
                with contextlib.suppress(TimeoutError):  # noted by the calibration when it comes
                    await asyncio.wait_for(asyncio.shield(counting), self.wait_seconds)
        return calibration.chars_per_token  # type: ignore[no-any-return]

    async def pool(self, target: str, node: str) -> int | None:
        """Return the node's smallest KV pool, or None when it is not known."""
        now = self.clock()
        kept = self._pools.get((target, node))
        if kept is not None and now - kept[0] < (POOL_SECONDS if kept[1] else UNKNOWN_POOL_SECONDS):
            return kept[1]
        key = (target, node)
        reading = self._reading.get(key)
        if reading is None:
            reading = self._reading[key] = _background(self._read_pool(target, node, now))
            reading.add_done_callback(lambda _: self._reading.pop(key, None))
        try:
            return await asyncio.wait_for(asyncio.shield(reading), self.wait_seconds)
        except TimeoutError:
            return kept[1] if kept is not None else None

    async def _read_pool(self, target: str, node: str, now: float) -> int | None:
        client = self.clients.get(target)
        found: int | None = None
        if client is not None and hasattr(client, "capacity"):
            nodes = getattr(client, "nodes", [])
            named = [n for n in nodes if n.name == node] if node else []
            # Addressed to the target itself (a gateway, whose own server info names no pool): the
            # request was admitted by one of its prefill or aggregated nodes, unknown which, so
            # only a prompt over the largest of their pools surely did not fit.
            admitting = [n for n in nodes if n.name and n.role != "decode"] if not node else []
            if named:
                found = smallest_pool(await client.node_capacity(named[0]))
            elif admitting:
                pools = [smallest_pool(await client.node_capacity(n)) for n in admitting]
                known = [pool for pool in pools if pool is not None]
                found = max(known) if len(known) == len(pools) else None  # one unknown: no sure bound
            else:
                found = smallest_pool(await client.capacity(max_age=POOL_SECONDS))
        self._pools[(target, node)] = (now, found)
        return found


def _background(work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """A task that may outlive its first waiter; a failure nobody awaits is not reported as lost."""
    task = asyncio.create_task(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
