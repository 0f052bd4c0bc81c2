"""Read functions for the REST API and the metrics collector. Keyword-only, read-only.

Time filters take timezone-aware datetimes (a naive one is taken as UTC); ``since`` is inclusive
and ``until`` exclusive.

Lists are newest first, with ``id`` breaking ties, and page by keyset: a page ends with the
:class:`Key` of its last row, and the next page holds the rows strictly older than that key, so
rows recorded meanwhile (which are newer) neither repeat nor push rows onto the next page. Each
page reads one ordered range of an index that leads with equality filters and ends in (time, id)
(``PROBE_RESULT_SCANS``, ``INCIDENT_SCANS``; the indexes are declared in ``models.py``), so a page
costs the same on a table of ten rows or ten million. Filters that the chosen index does not lead
with are applied to the rows of that range, at most ``scan_limit`` of them per page: such a page
may hold fewer than ``limit`` rows, even none, and still have a ``next_key`` (see
:func:`~monitor.storage.keyset.keyset_page`). Only ``next_key`` None means the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Row,
    Select,
    String,
    literal,
    select,
    union_all,
)
from sqlalchemy.orm import InstrumentedAttribute, Session

from kvcanary.monitor.storage.keyset import SCAN_LIMIT, Key, Listing, Page, keyset_page
from kvcanary.monitor.storage.models import Incident, IncidentEvent, ProbeResultRow, Target

__all__ = ["SCAN_LIMIT", "Key", "Page"]  # part of this module's interface; the machinery is keyset.py's

#: How many linked probe results an incident's detail carries by default.
DETAIL_RESULTS = 50

#: The equality filters each probe_result index leads with, before (started_at, id); a page uses
#: the first whose filters were all given. Tried in this order: a verdict filter is usually after
#: the rare failures, so (target, verdict) beats (target, probe) when both fit.
PROBE_RESULT_SCANS: tuple[tuple[str, ...], ...] = (
    ("target", "verdict"),
    ("target", "probe"),
    ("target",),
    ("verdict",),
    (),
)
#: The same for incident, before (opened_at, id). Open incidents are few, so state comes first.
INCIDENT_SCANS: tuple[tuple[str, ...], ...] = (("target", "state"), ("state",), ("target",), ())


@dataclass(frozen=True)
class IncidentDetail:
    """One incident with its whole timeline (oldest first) and its most recent linked results.

    ``incident`` and ``results`` are rows as in :class:`Page`; ``events`` are ORM objects.
    """

    incident: Row[Any]
    events: list[IncidentEvent]
    results: list[Row[Any]]


_RESULTS = Listing(
    ProbeResultRow,
    ProbeResultRow.id,
    ProbeResultRow.target_id,
    ProbeResultRow.started_at,
    {"probe": ProbeResultRow.probe, "node": ProbeResultRow.node, "verdict": ProbeResultRow.verdict},
    PROBE_RESULT_SCANS,
)
_INCIDENTS = Listing(
    Incident,
    Incident.id,
    Incident.target_id,
    Incident.opened_at,
    {"probe": Incident.probe, "node": Incident.node, "severity": Incident.severity, "state": Incident.state},
    INCIDENT_SCANS,
)


def list_incidents(
    session: Session,
    *,
    target: str | None = None,
    probe: str | None = None,
    node: str | None = None,
    severity: str | None = None,
    state: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after: Key | None = None,
    limit: int = 50,
    offset: int = 0,
    scan_limit: int = SCAN_LIMIT,
) -> Page:
    """Return one page of incidents, newest opened first.

    ``since``/``until`` bound ``opened_at``; ``after`` continues from a previous page's
    ``next_key``. A None filter does not filter. ``offset`` skips matching rows; see
    :func:`keyset_page` for what it costs, and the module docstring for ``scan_limit``.
    """
    filters = {"target": target, "probe": probe, "node": node, "severity": severity, "state": state}
    return keyset_page(
        session,
        _INCIDENTS,
        filters,
        since=since,
        until=until,
        after=after,
        limit=limit,
        offset=offset,
        scan_limit=scan_limit,
    )


def incident_opened_at(session: Session, incident_id: int) -> datetime | None:
    """Return when the incident opened (one primary-key read), or None when there is none."""
    return session.scalar(select(Incident.opened_at).where(Incident.id == incident_id))


def get_incident(
    session: Session, *, incident_id: int, results_limit: int = DETAIL_RESULTS
) -> IncidentDetail | None:
    """Return the incident with its events and its ``results_limit`` most recent linked results.

    Return None when no incident has that id.
    """
    incident = session.execute(_INCIDENTS.rows().where(Incident.id == incident_id)).one_or_none()
    if incident is None:
        return None
    events = session.scalars(
        select(IncidentEvent)
        .where(IncidentEvent.incident_id == incident_id)
        .order_by(IncidentEvent.created_at, IncidentEvent.id)
    )
    results = session.execute(
        _RESULTS.rows()
        .where(ProbeResultRow.incident_id == incident_id)
        .order_by(*_RESULTS.newest_first())
        .limit(results_limit)
    )
    return IncidentDetail(incident, list(events), list(results))


def list_probe_results(
    session: Session,
    *,
    target: str | None = None,
    probe: str | None = None,
    node: str | None = None,
    verdict: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after: Key | None = None,
    limit: int = 50,
    offset: int = 0,
    scan_limit: int = SCAN_LIMIT,
) -> Page:
    """Return one page of probe results, newest first.

    ``since``/``until`` bound ``started_at``; ``after`` continues from a previous page's
    ``next_key``. A None filter does not filter. ``offset`` skips matching rows; see
    :func:`keyset_page` for what it costs, and the module docstring for ``scan_limit``.
    """
    filters = {"target": target, "probe": probe, "node": node, "verdict": verdict}
    return keyset_page(
        session,
        _RESULTS,
        filters,
        since=since,
        until=until,
        after=after,
        limit=limit,
        offset=offset,
        scan_limit=scan_limit,
    )


def last_verdicts(
    session: Session, *, pairs: Iterable[tuple[str, str]]
) -> dict[str, dict[str, tuple[str, datetime, str, str]]]:
    """Return ``{target_name: {probe: (verdict, started_at, reason, node)}}`` of each pair's latest
    result (``node`` empty for a run of the whole target).

    ``pairs`` are the (target name, probe) pairs asked about; one that never recorded a result is
    absent. Latest means the greatest ``started_at``, then the greatest ``id``. Each (target, probe
    kind) costs a few descents of ``ix_probe_result_target_probe_started_id``, however long the
    history (see :func:`_latest`).
    """
    wanted = set(pairs)
    latest = [_latest(probe) for probe in sorted({probe for _, probe in wanted})]
    if not latest:
        return {}
    out: dict[str, dict[str, tuple[str, datetime, str, str]]] = {}
    for name, probe, verdict, started_at, reason, node in session.execute(union_all(*latest)):
        if verdict is not None and (name, probe) in wanted:
            out.setdefault(name, {})[probe] = (verdict, started_at, reason, node or "")
    return out


#: The most open incidents a target's entry lists (a gateway target's paths are at most 256, each
#: with a few probe kinds): newest first; the incidents API has them all.
OPEN_INCIDENTS_LISTED = 50


def open_incidents_by_target(
    session: Session, *, targets: Iterable[str]
) -> dict[str, list[tuple[int, str, str, str, datetime, str]]]:
    """Return ``{target_name: [(id, probe, node, severity, opened_at, certainty), ...]}`` of the open
    incidents of these targets, newest first, at most ``OPEN_INCIDENTS_LISTED`` each; a target with
    none is absent. One range of ``ix_incident_target_state_opened_id`` per target."""
    out: dict[str, list[tuple[int, str, str, str, datetime, str]]] = {}
    for name in sorted(set(targets)):
        columns = (Incident.id, Incident.probe, Incident.node, Incident.severity, Incident.opened_at)
        query = (
            select(*columns, Incident.certainty)
            .join(Target, Target.id == Incident.target_id)
            .where(Target.name == name, Incident.state == "open")
            .order_by(Incident.opened_at.desc(), Incident.id.desc())
            .limit(OPEN_INCIDENTS_LISTED)
        )
        rows = [
            (i, probe, node or "", severity, opened, certainty)
            for i, probe, node, severity, opened, certainty in session.execute(query)
        ]
        if rows:
            out[name] = rows
    return out


def _latest(probe: str) -> Select[Any]:
    """Return a SELECT of (target name, probe, verdict, started_at, reason, node) of the latest
    ``probe`` result of every target row (verdict None: it has none).

    Each value is a correlated subquery: one descent of the (target, probe, started_at, id) index
    per target, so no plan scans probe_result, whatever its size. The four see one snapshot and
    one order, hence one row. Naming no target keeps the statement constant for the caches.
    """

    def newest(column: InstrumentedAttribute[Any]) -> Any:
        return (
            select(column)
            .where(ProbeResultRow.target_id == Target.id, ProbeResultRow.probe == probe)
            .order_by(*_RESULTS.newest_first())
            .limit(1)
            .correlate(Target)
            .scalar_subquery()
        )

    return select(
        Target.name,
        literal(probe, String),
        newest(ProbeResultRow.verdict),
        newest(ProbeResultRow.started_at),
        newest(ProbeResultRow.reason),
        newest(ProbeResultRow.node),
    )
