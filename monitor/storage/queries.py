"""Read functions for the REST API and the metrics collector. Keyword-only, read-only.

Time filters take timezone-aware datetimes (a naive one is taken as UTC); ``since`` is inclusive
and ``until`` exclusive. Lists are newest first, with ``id`` breaking ties so pages are stable.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session, joinedload

from monitor.storage.db import as_utc
from monitor.storage.models import Incident, IncidentEvent, ProbeResult, Target

#: How many linked probe results an incident's detail carries by default.
DETAIL_RESULTS = 50


@dataclass(frozen=True)
class IncidentDetail:
    """One incident with its whole timeline (oldest first) and its most recent linked results."""

    incident: Incident
    events: list[IncidentEvent]
    results: list[ProbeResult]


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
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[Incident], int]:
    """Return one page of incidents (``target`` loaded), newest opened first, and the total matching.

    ``since``/``until`` bound ``opened_at``. A None filter does not filter.
    """
    query = _matching(
        select(Incident).join(Incident.target),
        {
            Target.name: target,
            Incident.probe: probe,
            Incident.node: node,
            Incident.severity: severity,
            Incident.state: state,
        },
    )
    query = _between(query, Incident.opened_at, since, until)
    total = _count(session, query)
    page = (
        query.options(joinedload(Incident.target))
        .order_by(Incident.opened_at.desc(), Incident.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(session.scalars(page)), total


def get_incident(
    session: Session, *, incident_id: int, results_limit: int = DETAIL_RESULTS
) -> IncidentDetail | None:
    """Return the incident with its events and its ``results_limit`` most recent linked results.

    Return None when no incident has that id.
    """
    incident = session.scalars(
        select(Incident).options(joinedload(Incident.target)).where(Incident.id == incident_id)
    ).one_or_none()
    if incident is None:
        return None
    events = session.scalars(
        select(IncidentEvent)
        .where(IncidentEvent.incident_id == incident_id)
        .order_by(IncidentEvent.created_at, IncidentEvent.id)
    )
    results = session.scalars(
        select(ProbeResult)
        .options(joinedload(ProbeResult.target))
        .where(ProbeResult.incident_id == incident_id)
        .order_by(ProbeResult.started_at.desc(), ProbeResult.id.desc())
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
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[ProbeResult], int]:
    """Return one page of probe results (``target`` loaded), newest first, and the total matching.

    ``since``/``until`` bound ``started_at``. A None filter does not filter.
    """
    query = _matching(
        select(ProbeResult).join(ProbeResult.target),
        {Target.name: target, ProbeResult.probe: probe, ProbeResult.node: node, ProbeResult.verdict: verdict},
    )
    query = _between(query, ProbeResult.started_at, since, until)
    total = _count(session, query)
    page = (
        query.options(joinedload(ProbeResult.target))
        .order_by(ProbeResult.started_at.desc(), ProbeResult.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(session.scalars(page)), total


def last_verdicts(session: Session) -> dict[str, dict[str, tuple[str, datetime, str]]]:
    """Return ``{target_name: {probe: (verdict, started_at, reason)}}`` of each pair's latest result.

    A (target, probe) that never recorded a result is absent. Latest means the greatest
    ``started_at``, then the greatest ``id``.
    """
    latest = (
        select(ProbeResult.target_id, ProbeResult.probe, func.max(ProbeResult.started_at).label("started_at"))
        .group_by(ProbeResult.target_id, ProbeResult.probe)
        .subquery()
    )
    query = (
        select(
            Target.name, ProbeResult.probe, ProbeResult.verdict, ProbeResult.started_at, ProbeResult.reason
        )
        .join(Target, Target.id == ProbeResult.target_id)
        .join(
            latest,
            (latest.c.target_id == ProbeResult.target_id)
            & (latest.c.probe == ProbeResult.probe)
            & (latest.c.started_at == ProbeResult.started_at),
        )
        # Ties on started_at: the highest id comes last and wins below.
        .order_by(ProbeResult.id)
    )
    out: dict[str, dict[str, tuple[str, datetime, str]]] = {}
    for name, probe, verdict, started_at, reason in session.execute(query):
        out.setdefault(name, {})[probe] = (verdict, started_at, reason)
    return out


def open_incident_counts(session: Session) -> list[tuple[str, str, str, str, int]]:
    """Return ``(target_name, probe, node, severity, count)`` for every open incident group.

    Groups with nothing open are absent; the metrics collector exports them as 0.
    """
    query = (
        select(Target.name, Incident.probe, Incident.node, Incident.severity, func.count())
        .join(Target, Target.id == Incident.target_id)
        .where(Incident.state == "open")
        .group_by(Target.name, Incident.probe, Incident.node, Incident.severity)
        .order_by(Target.name, Incident.probe, Incident.node, Incident.severity)
    )
    return [(name, probe, node, sev, int(count)) for name, probe, node, sev, count in session.execute(query)]


def _matching(query: Select[Any], equal: dict[Any, str | None]) -> Select[Any]:
    """Return ``query`` filtered on ``column == value`` for every value that is not None."""
    return query.where(*(column == value for column, value in equal.items() if value is not None))


def _between(query: Select[Any], column: Any, since: datetime | None, until: datetime | None) -> Select[Any]:
    if since is not None:
        query = query.where(column >= as_utc(since))
    if until is not None:
        query = query.where(column < as_utc(until))
    return query


def _count(session: Session, query: Select[Any]) -> int:
    return int(session.scalar(select(func.count()).select_from(query.order_by(None).subquery())) or 0)
