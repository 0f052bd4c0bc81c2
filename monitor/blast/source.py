"""What a blast-radius source is: one class behind ``BlastSource``, held in ``BlastSources``' list.

Every source answers the same question (``question.Scope``) in the same two shapes: a ``Tally``
(grouped counts) for the report, and the matching requests' ids for the notification list. The
report takes its figures from the most trusted source among those covering the window about as
well as the best one (``report.BlastRadius.primary``), and the notification list from that same
source's ``requests``, so nothing outside a source needs to know which sources exist: a new one
(another gateway's database, an export) is one class and its test, and a line in
``compute.configured_sources`` that builds it from the settings.

The sources today: ``RecordedTraffic`` (``recorded.py``), ``GatewayLogs`` (``logs.py``) and
``SpendLogs`` (``spendlogs.py``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sqlalchemy.orm import Session

from kvcanary.monitor.blast.question import Scope
from kvcanary.monitor.blast.tally import Tally

#: One matching response as a notification list names it: (request id, caller, own, epoch seconds).
#: ``own`` marks the monitor's own tenants, which the list leaves out.
RequestRow = tuple[str, str, bool, float]


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
