"""What the traffic judge and the admission guard need to know of a target, asked of its client
and kept a while.

- characters per token: the client's calibration (``monitor/targets/calibration.py``); while it
  has none, the judge's own count of the monitor's sample text, once per ``RECOUNT_SECONDS``. A
  density no tokenizer can make (:func:`plausible_density`) is none: one tokenizer answering
  nonsense must not make every prompt look short or long;
- each node's smallest KV pool: the node's own capacity reading (``node_capacity``; the target's
  ``capacity`` for a target without named nodes), kept ``POOL_SECONDS``; a reading that found no
  pool is kept ``UNKNOWN_POOL_SECONDS`` (an engine that publishes none is not asked for every
  batch), and one whose lookup went unanswered (a timeout, a 5xx) only ``UNANSWERED_POOL_SECONDS``:
  the node's last pool stands meanwhile, and a first reading missed on a loaded node does not leave
  a guarded deployment unguarded for a minute.

A pool reading is believed only where a real engine could have made it (:meth:`TargetFacts.reading`):

- ``below_floor``: a pool under ``MIN_TRUSTED_POOL_TOKENS``;
- ``below_own_input_limit``: every pool the node states is below the longest prompt the same answer
  says it admits (``max_req_input_len``, which SGLang and the reference worker derive from the
  pool: always below it);
- ``moved``: a pool more than ``POOL_MOVE_FACTOR`` times larger or smaller than the node's last
  trusted one, with no configuration change the capacity audit saw since (a pool is fixed when the
  engine starts; the audit's change calls :meth:`TargetFacts.forget_pools`, and the next reading
  is the node's new baseline), held for less than ``POOL_SETTLE_SECONDS`` (a restart nobody
  announced, on a target the audit does not watch, is believed once its pool has held that long).

A reading not trusted is kept as such (``untrusted``, ``kvcanary_node_pool_untrusted``), logged
once an episode and read again after ``UNKNOWN_POOL_SECONDS``; it judges nothing and guards nothing
(:meth:`TargetFacts.pool` is None for it).

A batch waits at most ``FACT_WAIT_SECONDS`` for either (a hung target read with its 30 s timeout
stalled every batch behind it, and the tap's 5 s post with them): past that it is judged with
what is known (the last reading, or none), and the reading goes on, once however many batches
ask, for the batches after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from kvcanary.monitor.targets.calibration import RECOUNT_SECONDS, SAMPLE_TEXT
from kvcanary.probes.target import ServerCapacity
from kvcanary.wire import MAX_TOKEN_BYTES

log = logging.getLogger("kvcanary.traffic")

POOL_SECONDS = 600.0
UNKNOWN_POOL_SECONDS = 60.0
UNANSWERED_POOL_SECONDS = 5.0
FACT_WAIT_SECONDS = 2.5
#: The smallest KV pool believed: 256 tokens, 16 pages of 16. No engine serving a model is run
#: with less (a chat template and one short question fill it; the reference worker's smallest pool
#: in any demo or test is 1,024): a node saying so is broken or lying, and an admission guard made
#: of it would refuse nearly every prompt of every deployment it bounds.
MIN_TRUSTED_POOL_TOKENS = 256
#: How far a node's pool may move between readings before the capacity audit saw its configuration
#: change: a pool is fixed when the engine starts, so a move at all is a restart, and one this
#: large (a quarter, four times) unannounced is a reading not to act on until the audit confirms it.
POOL_MOVE_FACTOR = 4.0
#: How long a moved pool must read the same before it is believed without the audit's word.
POOL_SETTLE_SECONDS = 3600.0
#: The sparsest text a tokenizer can make of a calibration sample: a token a UTF-8 byte, four bytes
#: a character, and a few tokens the tokenizer adds around a short text. Denser than
#: ``MAX_TOKEN_BYTES`` characters a token (a character is at least a byte) is as impossible.
MIN_CHARS_PER_TOKEN = 1 / 8
#: Why a pool reading is not trusted (module doc).
DOUBTS = ("below_floor", "below_own_input_limit", "moved")


def smallest_pool(reading: ServerCapacity) -> int | None:
    sizes = [n for n in (reading.kv_pool_tokens, *reading.pools.values()) if n]
    return min(sizes) if sizes else None


def plausible_density(chars_per_token: float | None) -> float | None:
    """Return ``chars_per_token`` where a tokenizer could have measured it, else None."""
    if chars_per_token is None or not MIN_CHARS_PER_TOKEN <= chars_per_token <= MAX_TOKEN_BYTES:
        return None
    return chars_per_token


@dataclass(frozen=True)
class PoolReading:
    """A node's smallest KV pool as read (``tokens``, None: none found) and, where it is not to be
    believed, why (``doubt``, one of ``DOUBTS``)."""

    tokens: int | None
    doubt: str | None = None

    @property
    def trusted(self) -> int | None:
        """Return the pool where it is believed, else None."""
        return self.tokens if self.doubt is None else None


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
        #: The pool readings not trusted now, by (target, node): why (``DOUBTS``).
        self.untrusted: dict[tuple[str, str], str] = {}
        self._counted: dict[str, float] = {}  # when the judge last counted SAMPLE_TEXT, by target
        self._pools: dict[tuple[str, str], tuple[float, PoolReading]] = {}  # until when, the reading
        self._reading: dict[tuple[str, str], asyncio.Task[PoolReading]] = {}
        self._baseline: dict[tuple[str, str], int] = {}  # each node's last trusted pool
        self._moved: dict[tuple[str, str], tuple[int, float]] = {}  # a moved pool, since when

    def forget(self, target: str) -> None:
        """Drop what is kept of ``target`` (a reload gave it a new client, or removed it): its
        readings are read again; the last trusted pool of each node it still has stays, so a
        reload does not make an unannounced move look like a first reading."""
        self._counted.pop(target, None)
        self._pools = {k: v for k, v in self._pools.items() if k[0] != target}
        client = self.clients.get(target)
        nodes = {"", *(n.name for n in getattr(client, "nodes", []))} if client is not None else set()
        self._baseline = {k: v for k, v in self._baseline.items() if k[0] != target or k[1] in nodes}
        self._moved = {k: v for k, v in self._moved.items() if k[0] != target or k[1] in nodes}
        self.untrusted = {k: v for k, v in self.untrusted.items() if k[0] != target or k[1] in nodes}

    def forget_pools(self, target: str) -> None:
        """Drop the pools kept of ``target``: its configuration changed (the capacity audit saw it),
        so they are read again and each node's next reading is its new baseline."""
        self._pools = {k: v for k, v in self._pools.items() if k[0] != target}
        self._baseline = {k: v for k, v in self._baseline.items() if k[0] != target}
        self._moved = {k: v for k, v in self._moved.items() if k[0] != target}

    async def chars_per_token(self, target: str) -> float | None:
        """Return the target's calibration where a tokenizer could have made it, else None."""
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
        return plausible_density(calibration.chars_per_token)

    async def pool(self, target: str, node: str) -> int | None:
        """Return the node's smallest KV pool, or None when it is not known or not trusted."""
        reading = await self.reading(target, node)
        return None if reading is None else reading.trusted

    async def reading(self, target: str, node: str) -> PoolReading | None:
        """Return the node's pool reading as last made (trusted or not), or None when none is
        known (not read yet within the wait, or read and found no pool)."""
        now = self.clock()
        key = (target, node)
        kept = self._pools.get(key)
        if kept is not None and now < kept[0]:
            return _known(kept[1])
        reading = self._reading.get(key)
        if reading is None:
            reading = self._reading[key] = _background(self._read_pool(target, node, now))
            reading.add_done_callback(lambda _: self._reading.pop(key, None))
        try:
            return _known(await asyncio.wait_for(asyncio.shield(reading), self.wait_seconds))
        except TimeoutError:
            return _known(kept[1]) if kept is not None else None

    async def _read_pool(self, target: str, node: str, now: float) -> PoolReading:
        client = self.clients.get(target)
        found = PoolReading(None)
        if client is not None and hasattr(client, "capacity"):
            nodes = getattr(client, "nodes", [])
            named = [n for n in nodes if n.name == node] if node else []
            # Addressed to the target itself (a gateway, whose own server info names no pool): the
            # request was admitted by one of its prefill or aggregated nodes, unknown which, so
            # only a prompt over the largest of their pools surely did not fit.
            admitting = [n for n in nodes if n.name and n.role != "decode"] if not node else []
            if named:
                capacity = await client.node_capacity(named[0])
            elif admitting:
                pools = await asyncio.gather(*(self.pool(target, n.name) for n in admitting))
                known = [pool for pool in pools if pool is not None]
                # One unknown or untrusted: no sure bound (asked again soon: each node keeps its own).
                found = PoolReading(max(known) if len(known) == len(pools) else None)
                lifetime = POOL_SECONDS if found.tokens is not None else UNANSWERED_POOL_SECONDS
                self._pools[(target, node)] = (now + lifetime, found)
                return found
            else:
                capacity = await client.capacity(max_age=POOL_SECONDS)
            if capacity.unanswered and smallest_pool(capacity) is None:
                return self._unanswered((target, node), now, capacity)
            found = self._judged((target, node), capacity)
        lifetime = POOL_SECONDS if found.trusted is not None else UNKNOWN_POOL_SECONDS
        self._pools[(target, node)] = (now + lifetime, found)
        return found

    def _unanswered(self, key: tuple[str, str], now: float, capacity: ServerCapacity) -> PoolReading:
        """A node whose lookup went unanswered: its last reading stands (a pool is fixed while the
        engine runs), and it is asked again ``UNANSWERED_POOL_SECONDS`` on."""
        last = self._pools.get(key)
        standing = last[1] if last is not None else PoolReading(None)
        if last is None:  # once: a node that never answers is asked again quietly
            log.info("%s: the KV pool is not read yet: %s", _where(key), capacity.source or "no answer")
        self._pools[key] = (now + UNANSWERED_POOL_SECONDS, standing)
        return standing

    def _judged(self, key: tuple[str, str], capacity: ServerCapacity) -> PoolReading:
        """Return the pool ``capacity`` states and whether to believe it (module doc); keep a
        trusted one as the node's baseline, and note and log an untrusted one once an episode."""
        tokens = smallest_pool(capacity)
        doubt = None if tokens is None else self._doubt(key, capacity, tokens)
        was = self.untrusted.get(key)
        if doubt is None:
            self.untrusted.pop(key, None)
            if tokens is not None:
                self._baseline[key] = tokens
            if was is not None:
                log.info("%s: the KV pool reading is trusted again (%s tokens)", _where(key), tokens)
        elif doubt != was:
            self.untrusted[key] = doubt
            log.warning("%s: a KV pool reading of %s tokens is not trusted (%s%s): it guards and judges "
                        "nothing (kvcanary_node_pool_untrusted)", _where(key), tokens, doubt,
                        _figures(capacity, doubt, self._baseline.get(key)))  # fmt: skip
        return PoolReading(tokens, doubt)

    def _doubt(self, key: tuple[str, str], capacity: ServerCapacity, tokens: int) -> str | None:
        if tokens < MIN_TRUSTED_POOL_TOKENS:
            return "below_floor"
        # Every pool it states: a data-parallel node's top-level limit is one rank's, and that rank's
        # pool may be larger than the smallest.
        stated = [tokens, *capacity.pools.values(), *capacity.rank_pools.values()]
        if capacity.max_req_input_len and max(stated) < capacity.max_req_input_len:
            return "below_own_input_limit"
        base = self._baseline.get(key)
        if base is not None and not base / POOL_MOVE_FACTOR <= tokens <= base * POOL_MOVE_FACTOR:
            moved = self._moved.get(key)
            if moved is None or moved[0] != tokens:
                self._moved[key] = (tokens, self.clock())
                return "moved"
            if self.clock() - moved[1] < POOL_SETTLE_SECONDS:
                return "moved"
        self._moved.pop(key, None)
        return None


def _known(reading: PoolReading) -> PoolReading | None:
    return None if reading.tokens is None else reading


def _where(key: tuple[str, str]) -> str:
    target, node = key
    return f"{target}: node {node}" if node else target


def _figures(capacity: ServerCapacity, doubt: str, base: int | None) -> str:
    if doubt == "below_floor":
        return f", under {MIN_TRUSTED_POOL_TOKENS}"
    if doubt == "below_own_input_limit":
        return f", under its own max_req_input_len of {capacity.max_req_input_len}"
    return f", from {base} with no configuration change seen" if base is not None else ""


def _background(work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """A task that may outlive its first waiter; a failure nobody awaits is not reported as lost."""
    task = asyncio.create_task(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
