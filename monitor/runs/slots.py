"""Run slots shared fairly between targets, so a hung or slow target costs its own probes only.

A first-come semaphore lets whoever asks most hold the slots: 40 targets that never answer kept
every slot for their whole budget while healthy targets waited minutes. :class:`FairSlots` bounds
the runs in flight as before, and decides who gets the next free slot the way a fair-queueing
scheduler does:

- **least recent use first**: each target's slot-seconds (finished runs, decaying with a
  half-life, plus the runs it has in flight now) order the waiters; the waiter whose target used
  the least goes first, so a target whose runs take 50 ms is served before one whose runs take
  5 s, however many of those queue (FIFO among equals). A target never seen to finish a run counts
  as having used ``unknown_cost`` (the lease): hundreds of slow targets' first runs queued at start
  must not pass a target already known to be quick, as they would with a usage of zero;
- **a cap per target**: no target has more than ``per_target`` runs in flight;
- **leases**: a run still waiting on the network when its lease ends gives its slot back and waits
  on in *overtime* (bounded apart, ``overtime``): it costs a socket, not a slot;
- **a share for slow targets**: runs of targets not known to be quick (their last run outlived its
  lease or timed out, or they have not run yet) hold at most ``slow_share`` of the slots together,
  so the rest stays free for targets known to be quick, even when overtime is full and a thousand
  first runs queue at start.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

#: Slot-seconds a target used count half as much after this long.
HALF_LIFE_SECONDS = 300.0


@dataclass
class _Usage:
    seconds: float = 0.0
    at: float = 0.0

    def now(self, t: float) -> float:
        return self.seconds * math.exp2(-(t - self.at) / HALF_LIFE_SECONDS)


@dataclass
class _Waiter:
    target: str
    slow: bool
    seq: int
    granted: asyncio.Future[Lease] = field(repr=False)


class Lease:
    """One run's hold on a slot; :meth:`overtime` trades the slot for an overtime place.

    ``expired``: the lease ended before the run did (whether or not an overtime place was free).
    """

    def __init__(self, slots: FairSlots, target: str, slow: bool, started: float) -> None:
        self._slots = slots
        self.target = target
        self.slow = slow
        self.started = started
        self.in_overtime = False
        self.expired = False
        self.released = False

    def overtime(self) -> None:
        """The lease is over: give the slot back while the run goes on, if an overtime place is free."""
        if self.released:  # a timer that outlived its run: nothing to give back
            return
        self.expired = True
        self._slots._to_overtime(self)


class FairSlots:
    """``total`` run slots handed out fairly between targets (see the module docstring)."""

    def __init__(
        self,
        total: int,
        per_target: int,
        slow_share: float = 0.5,
        overtime: int | None = None,
        unknown_cost: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.per_target = per_target
        self.slow_limit = max(1, math.floor(total * slow_share))
        self.overtime_limit = 8 * total if overtime is None else overtime
        self.unknown_cost = unknown_cost
        self._clock = clock
        self._leases: dict[str, list[Lease]] = {}
        self._held = 0  # slots held (leases not in overtime)
        self._held_slow = 0
        self._overtime = 0
        self._usage: dict[str, _Usage] = {}
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def in_use(self) -> int:
        return self._held

    @property
    def in_overtime(self) -> int:
        return self._overtime

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def hold(self, target: str, slow: bool = False) -> AsyncIterator[Lease]:
        """Hold one slot for ``target`` while the block runs; ``slow``: the target is known to be slow."""
        lease = await self._acquire(target, slow)
        try:
            yield lease
        finally:
            self._release(lease)

    async def _acquire(self, target: str, slow: bool) -> Lease:
        waiter = _Waiter(target, slow, next(self._seq), asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._dispatch()
        try:
            return await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release(waiter.granted.result())  # granted as it was cancelled
            else:
                if waiter in self._waiters:  # a dispatch may have dropped it already
                    self._waiters.remove(waiter)
                self._dispatch()  # it may have been the one that kept an eligible waiter back
            raise

    def _give_back(self, slow: bool) -> None:
        self._held -= 1
        self._held_slow -= slow

    def _to_overtime(self, lease: Lease) -> None:
        if lease.in_overtime or self._overtime >= self.overtime_limit:
            return
        lease.in_overtime = True
        self._overtime += 1
        self._give_back(lease.slow)
        self._dispatch()

    def _release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        if lease.in_overtime:
            self._overtime -= 1
        else:
            self._give_back(lease.slow)
        leases = self._leases[lease.target]
        leases.remove(lease)
        if not leases:
            del self._leases[lease.target]  # only targets with runs in flight are kept
        now = self._clock()
        usage = self._usage.setdefault(lease.target, _Usage())
        usage.seconds, usage.at = usage.now(now) + (now - lease.started), now
        self._dispatch()

    def _eligible(self, waiter: _Waiter) -> bool:
        if len(self._leases.get(waiter.target, ())) >= self.per_target:
            return False
        return not waiter.slow or self._held_slow < self.slow_limit

    def _dispatch(self) -> None:
        """Grant free slots to the eligible waiters whose targets used the least, oldest first."""
        # Waiters cancelled but not yet woken hold no claim: a grant to them would be lost.
        self._waiters = [w for w in self._waiters if not w.granted.done()]
        while self._held < self.total and self._waiters:
            now = self._clock()
            ready = [w for w in self._waiters if self._eligible(w)]
            if not ready:
                return
            best = min(ready, key=lambda w: (self.usage(w.target, now), w.seq))
            self._waiters.remove(best)
            self._held += 1
            self._held_slow += best.slow
            # In flight from now: a second waiter of one target cannot pass the cap meanwhile.
            lease = Lease(self, best.target, best.slow, now)
            self._leases.setdefault(best.target, []).append(lease)
            best.granted.set_result(lease)

    def usage(self, target: str, now: float | None = None) -> float:
        """Return ``target``'s slot-seconds: finished runs (decayed) and its runs in flight."""
        now = self._clock() if now is None else now
        used = self._usage.get(target)
        finished = self.unknown_cost if used is None else used.now(now)
        return finished + sum(now - lease.started for lease in self._leases.get(target, ()))

    def forget(self, keep: set[str]) -> None:
        """Drop the usage of targets no longer configured (a reload removed them)."""
        for name in [n for n in self._usage if n not in keep]:
            del self._usage[name]
