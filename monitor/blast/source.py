"""What a blast-radius source is and what it answers: one class behind ``BlastSource``, held in
``BlastSources``' list, each answering with a ``Tally``.

Every source answers the same question (``question.Scope``) in the same two shapes: a ``Tally``
(grouped counts) for the report, and the matching requests' ids for the notification list. The
report takes its figures from the most trusted source among those covering the window about as
well as the best one (``report.BlastRadius.primary``), and the notification list from that same
source's ``requests``, so nothing outside a source needs to know which sources exist: a new one
(another gateway's database, an export) is one class and its test, and a line in
``compute.configured_sources`` that builds it from the settings.

A tally holds caller groups ``(caller, own, responses, first, last)`` with times as epoch seconds,
and the customers' responses per time bucket (the monitor's own and the callers the operator
excludes left out: ``Scope.exclude``): each source counts in its own engine (SQL or DuckDB) and the
report reads them all alike. Grouping by caller and by bucket apart keeps the answer to callers +
buckets rows, however many callers a large incident has.

The sources today: ``RecordedTraffic`` (``recorded.py``), ``GatewayLogs`` (``logs.py``) and
``SpendLogs`` (``spendlogs.py``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from sqlalchemy.orm import Session

from kvcanary.monitor.blast.question import Scope

#: One matching response as a notification list names it: (request id, caller, own, epoch seconds).
#: ``own`` marks the monitor's own tenants, which the list leaves out.
RequestRow = tuple[str, str, bool, float]


@dataclass
class CallerCount:
    responses: int = 0
    first: float = float("inf")
    last: float = float("-inf")

    def add(self, n: int, first: float, last: float) -> None:
        self.responses += n
        self.first = min(self.first, first)
        self.last = max(self.last, last)

    def as_json(self, caller: str) -> dict[str, Any]:
        return {
            "caller": caller,
            "responses": self.responses,
            "first": _iso(self.first),
            "last": _iso(self.last),
        }


@dataclass
class Tally:
    """One source's answer. ``covered`` is False where the source holds nothing of the target in
    the window (then its zero is no answer); ``note`` says what limits it."""

    name: str  # the source's name (``BlastSource.name``)
    detail: str  # what was read (a glob, a table), never a credential
    covered: bool = False
    rows_read: int | None = None
    notes: list[str] = field(default_factory=list)
    callers: dict[str, CallerCount] = field(default_factory=dict)
    own: dict[str, CallerCount] = field(default_factory=dict)
    #: Matching responses per time bucket: customers only (no own tenant, no excluded caller).
    buckets: Counter[int] = field(default_factory=Counter)
    #: The first and last time (epoch) the source holds anything: how much of the window it covers.
    span: tuple[float, float] | None = None
    #: The source that counted it: the report asks it how far it is trusted, and the notification
    #: list asks it for the ids (None: counted outside a source list, by a reader called alone).
    source: BlastSource | None = field(default=None, repr=False, compare=False)

    def coverage(self, start: float, end: float, grain: float = 0.0) -> float:
        """The share of the window ``[start, end]`` the source's span covers (0 without one).

        With a ``grain`` (seconds), the span is first widened to whole grains, so that a source
        timed to the millisecond and one counted by the minute compare alike."""
        if self.span is None or not self.covered:
            return 0.0
        if end <= start:
            return 1.0
        first, last = self.span
        if grain > 0:
            first, last = math.floor(first / grain) * grain, math.ceil(last / grain) * grain
        inside = min(end, last) - max(start, first)
        return max(0.0, min(1.0, inside / (end - start)))

    def add_callers(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Add caller groups ``(caller, own, responses, first, last)``."""
        for caller, own, n, first, last in rows:
            book = self.own if own else self.callers
            book.setdefault(caller or "", CallerCount()).add(int(n), float(first), float(last))

    def add_buckets(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Add ``(bucket, responses)`` rows."""
        for bucket, n in rows:
            self.buckets[int(bucket)] += int(n)

    @property
    def responses(self) -> int:
        return sum(c.responses for c in self.callers.values())

    def customer_responses(self, exclude: Iterable[str]) -> int:
        """The responses of the callers not excluded (the monitor's own are never in ``callers``)."""
        left_out = set(exclude)
        return sum(c.responses for name, c in self.callers.items() if name not in left_out)


@runtime_checkable
class BlastSource(Protocol):
    """A source of the requests a gateway served, counted for an incident's blast radius.

    A source never raises for what it cannot read: its ``tally`` says so in its notes (a missing
    file, a database that refused), since one broken source must not cost the report the others.
    ``requests`` may raise ``ValueError`` (naming the source, never a credential): the operator
    asked for that source's list and must hear why there is none.
    """

    @property
    def name(self) -> str:
        """How the report names the source (the API's ``sources[].name``, the disclosure's
        "Counted from ..."): no path, host or credential, since the incident page shows it."""

    @property
    def about(self) -> str:
        """One line saying what kind of record the source holds (the API's ``sources[].about``)."""

    @property
    def trust(self) -> int:
        """How far the source's figures are trusted: higher wins among the sources that cover the
        window about as well as the best one (every request with its id beats minute counts)."""

    def tally(self, session: Session, scope: Scope) -> Tally:
        """Count the responses ``scope`` asks about, by caller and by time bucket. The tally's
        ``source`` is this source, which is how the notification list finds its way back here."""

    def requests(self, session: Session, scope: Scope, limit: int) -> list[RequestRow]:
        """Return at most ``limit`` matching responses, oldest first, one per response (however
        many share an id), the monitor's own marked: what ``tally`` counted, by id."""


def _iso(epoch: float) -> str | None:
    if epoch in (float("inf"), float("-inf")):
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")
