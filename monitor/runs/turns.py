"""Turns on a target: a kind whose evidence depends on what a node does between two of its own
requests runs with no run of another kind on that target in between.

``boundary`` primes the head of a node's free list with another tenant's markers just before its
over-capacity prompt, so that a defective decode's stale read meets them: certain evidence, a
``leak`` that quarantines. A run of another kind on the same target meanwhile (``canary``,
``cross_tenant``: the probing tenant's own prompts) frees its pages onto that head, and the stale
read meets the probing tenant's own text instead: the over-pool 200 is judged a ``mismatch``
(paged, not proven) where the node leaks. Customers' traffic can still come between; the monitor's
own runs no longer do.

A target's turn is held by one *group* at a time: every kind that may share the target
(``""``), or one kind that runs alone (its name: its runs on several paths of the target share
their turn, as before). Waiters are served in order, and a run that could join the group holding
the turn waits behind an earlier waiter of another group, so a busy target cannot starve a lone
kind. A target's turn is forgotten once nobody holds or waits for it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

#: The group of every kind that does not run alone.
SHARED = ""


@dataclass
class _Turn:
    group: str | None = None  # who holds the turn (None: nobody)
    holders: int = 0
    waiting: deque[tuple[str, asyncio.Future[None]]] = field(default_factory=deque)


class TargetTurns:
    """Each target's turn, taken by a run for its group (:data:`SHARED`, or a lone kind's name)."""

    def __init__(self) -> None:
        self._turns: dict[str, _Turn] = {}

    @asynccontextmanager
    async def take(self, target: str, group: str) -> AsyncIterator[None]:
        """Hold ``target``'s turn for ``group`` while the block runs."""
        turn = self._turns.setdefault(target, _Turn())
        if not turn.waiting and turn.group in (None, group):
            turn.group = group
            turn.holders += 1
        else:
            granted = asyncio.get_running_loop().create_future()
            turn.waiting.append((group, granted))
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():  # granted as it was cancelled
                    self._leave(target, turn)
                else:
                    self._pass_on(target, turn)  # it may have been the waiter at the head
                raise
        try:
            yield
        finally:
            self._leave(target, turn)

    def _leave(self, target: str, turn: _Turn) -> None:
        turn.holders -= 1
        if turn.holders == 0:
            turn.group = None
        self._pass_on(target, turn)

    def _pass_on(self, target: str, turn: _Turn) -> None:
        """Grant the turn to the waiters at the head that share one group, once it is free."""
        while turn.waiting:
            group, granted = turn.waiting[0]
            if granted.done():  # cancelled while it waited
                turn.waiting.popleft()
                continue
            if turn.group is None:
                turn.group = group
            if group != turn.group:
                break
            turn.waiting.popleft()
            turn.holders += 1
            granted.set_result(None)
        if turn.group is None and self._turns.get(target) is turn:
            del self._turns[target]
