"""The paging outbox: ``incident_event`` rows not yet accepted by any Alertmanager.

A pager claims a batch by compare-and-set (``claimed_by``/``claimed_until``), so two monitor
replicas never deliver one event twice; a claim its pager did not live to finish lapses after the
lease and another pager takes the event over. An event is done (``processed_at`` set) only once
an Alertmanager accepted it. Events are handed out oldest first, and never an event of an
incident whose older event another pager holds: one incident's changes arrive in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from kvcanary.monitor.storage.db import as_utc
from kvcanary.monitor.storage.models import Incident, IncidentEvent, ProbeResultRow, QuarantineChange, Target

ERROR_CHARS = 200


@dataclass(frozen=True)
class IncidentView:
    """An incident as an alert shows it, with the figures of the result that last changed it."""

    id: int
    target: str
    probe: str
    node: str
    severity: str
    state: str
    title: str
    opened_at: datetime
    resolved_at: datetime | None
    failure_count: int
    last_reason: str
    result: dict[str, Any] = field(default_factory=dict)
    #: What the incident's target's quarantine has been since the incident opened, in words ("" none).
    containment: str = ""
    #: How its failures are known: certain, suspected, or confirmed by an operator.
    certainty: str = "certain"


@dataclass(frozen=True)
class PendingEvent:
    """A claimed event: what changed, and the incident it changed."""

    id: int
    kind: str
    created_at: datetime
    old_severity: str | None
    new_severity: str
    incident: IncidentView


def claim(
    session: Session, *, claimer: str, now: datetime, lease_seconds: float, limit: int = 50
) -> list[PendingEvent]:
    """Claim up to ``limit`` undelivered events for ``claimer`` and return them, oldest first."""
    now = as_utc(now)
    until = now + timedelta(seconds=lease_seconds)
    free = or_(IncidentEvent.claimed_until.is_(None), IncidentEvent.claimed_until < now)
    held_elsewhere = select(IncidentEvent.incident_id).where(
        IncidentEvent.processed_at.is_(None),
        IncidentEvent.claimed_until >= now,
        IncidentEvent.claimed_by != claimer,
    )
    candidates = list(
        session.scalars(
            select(IncidentEvent.id)
            .where(
                IncidentEvent.processed_at.is_(None), free, IncidentEvent.incident_id.not_in(held_elsewhere)
            )
            .order_by(IncidentEvent.created_at, IncidentEvent.id)
            .limit(limit)
        )
    )
    if not candidates:
        return []
    session.execute(
        update(IncidentEvent)
        .where(IncidentEvent.id.in_(candidates), IncidentEvent.processed_at.is_(None), free)
        .values(claimed_by=claimer, claimed_until=until),
        execution_options={"synchronize_session": False},
    )
    won = session.execute(
        select(IncidentEvent)
        .where(IncidentEvent.claimed_by == claimer, IncidentEvent.claimed_until == until)
        .where(IncidentEvent.processed_at.is_(None))
        .order_by(IncidentEvent.created_at, IncidentEvent.id)
    ).scalars()
    events = list(won)
    views = incident_views(session, [e.incident_id for e in events])
    return [
        PendingEvent(e.id, e.kind, e.created_at, e.old_severity, e.new_severity, views[e.incident_id])
        for e in events
    ]


def delivered(
    session: Session, *, event_ids: list[int], claimer: str, now: datetime, error: str | None = None
) -> int:
    """Mark events done; only those still claimed by ``claimer`` (a lapsed claim may have moved on).

    ``error`` says why an event is done without being accepted (every Alertmanager refused it for
    good: retrying a malformed alert would block the outbox forever).
    """
    result = session.execute(
        update(IncidentEvent)
        .where(IncidentEvent.id.in_(event_ids), IncidentEvent.claimed_by == claimer)
        .where(IncidentEvent.processed_at.is_(None))
        .values(
            processed_at=as_utc(now),
            claimed_until=None,
            attempts=IncidentEvent.attempts + 1,
            last_error=error[:ERROR_CHARS] if error else None,
        ),
        execution_options={"synchronize_session": False},
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def release(session: Session, *, event_ids: list[int], claimer: str) -> None:
    """Hand claimed events back unsent, with no attempt counted (the pager ran out of lease)."""
    session.execute(
        update(IncidentEvent)
        .where(IncidentEvent.id.in_(event_ids), IncidentEvent.claimed_by == claimer)
        .where(IncidentEvent.processed_at.is_(None))
        .values(claimed_until=None),
        execution_options={"synchronize_session": False},
    )


def failed(session: Session, *, event_ids: list[int], claimer: str, error: str) -> None:
    """Give claimed events back after a failed delivery, counting the attempt and keeping why."""
    session.execute(
        update(IncidentEvent)
        .where(IncidentEvent.id.in_(event_ids), IncidentEvent.claimed_by == claimer)
        .where(IncidentEvent.processed_at.is_(None))
        .values(claimed_until=None, attempts=IncidentEvent.attempts + 1, last_error=error[:ERROR_CHARS]),
        execution_options={"synchronize_session": False},
    )


def backlog(session: Session, *, now: datetime) -> tuple[int, float]:
    """Return (undelivered events, age in seconds of the oldest; 0 when none waits)."""
    count, oldest = session.execute(
        select(func.count(), func.min(IncidentEvent.created_at)).where(IncidentEvent.processed_at.is_(None))
    ).one()
    if not count or oldest is None:
        return 0, 0.0
    return int(count), max(0.0, (as_utc(now) - as_utc(oldest)).total_seconds())


def alerting_incidents(
    session: Session, *, now: datetime, resolved_within_seconds: float
) -> list[IncidentView]:
    """Return every open incident and every one resolved in the last ``resolved_within_seconds``,
    oldest first, leaving out a resolved one whose (target, probe, node) has a newer incident.

    Alertmanager knows an alert by its labels, not by incident: the resolved alert of an incident
    that relapsed would otherwise overwrite the new incident's firing one (a false "resolved" in
    the middle of a leak, then a second page).
    """
    since = as_utc(now) - timedelta(seconds=resolved_within_seconds)
    rows = session.execute(
        select(Incident.id, Incident.state, Incident.target_id, Incident.probe, Incident.node)
        .where(or_(Incident.state == "open", Incident.resolved_at >= since))
        .order_by(Incident.id)
    ).all()
    newest = {(r.target_id, r.probe, r.node): r.id for r in rows}  # ordered by id: the last wins
    ids = [r.id for r in rows if r.state == "open" or newest[(r.target_id, r.probe, r.node)] == r.id]
    views = incident_views(session, ids)
    return [views[i] for i in ids]


def incident_views(session: Session, incident_ids: list[int]) -> dict[int, IncidentView]:
    """Return the incidents by id, each with the figures of its most recent failing result."""
    if not incident_ids:
        return {}
    rows = session.execute(
        select(Incident, Target.name)
        .join(Target, Target.id == Incident.target_id)
        .where(Incident.id.in_(incident_ids))
    ).all()
    latest = _latest_failures(session, {incident.id: incident.severity for incident, _ in rows})
    quarantine = _latest_quarantine(session, {incident.target_id for incident, _ in rows})
    return {
        incident.id: IncidentView(
            id=incident.id,
            target=name,
            probe=incident.probe,
            node=incident.node,
            severity=incident.severity,
            state=incident.state,
            title=incident.title,
            opened_at=incident.opened_at,
            resolved_at=incident.resolved_at,
            failure_count=incident.failure_count,
            last_reason=incident.last_reason,
            result=latest.get(incident.id, {}),
            containment=_quarantine_words(quarantine.get(incident.target_id), incident.opened_at),
            certainty=incident.certainty,
        )
        for incident, name in rows
    }


def _latest_quarantine(session: Session, target_ids: set[int]) -> dict[int, QuarantineChange]:
    """Return each target's latest quarantine change (``monitor/containment/rules.py``)."""
    if not target_ids:
        return {}
    newest = (
        select(func.max(QuarantineChange.id))
        .where(QuarantineChange.target_id.in_(target_ids))
        .group_by(QuarantineChange.target_id)
        .scalar_subquery()
    )
    return {
        row.target_id: row
        for row in session.scalars(select(QuarantineChange).where(QuarantineChange.id.in_(newest)))
    }


def _quarantine_words(change: QuarantineChange | None, opened_at: datetime) -> str:
    """Say what the target's quarantine has been since the incident opened; "" when nothing changed."""
    if change is None or as_utc(change.at) < as_utc(opened_at):
        return ""
    at = as_utc(change.at).strftime("%Y-%m-%d %H:%M:%SZ")
    if not change.quarantined:
        return f"quarantine lifted at {at} ({change.cause}): {change.reason}"
    state = (
        "quarantined: the gateways send it no customer"
        if change.enforced
        else "would be quarantined (observe)"
    )
    return f"{state} since {at} ({change.cause}): {change.reason}"


#: The verdict that gives an incident its severity (``monitor/incidents.py``).
SEVERITY_VERDICT = {"critical": "leak", "high": "mismatch", "warning": "error"}


def _latest_failures(session: Session, severities: dict[int, str]) -> dict[int, dict[str, Any]]:
    """Return, per incident, the figures its alert describes: the newest result with the verdict of
    the incident's severity (a leak for a critical one, though a mismatch came after it), else the
    newest non-pass result."""
    newest_by_verdict = session.execute(
        select(ProbeResultRow.incident_id, ProbeResultRow.verdict, func.max(ProbeResultRow.id))
        .where(ProbeResultRow.incident_id.in_(list(severities)), ProbeResultRow.verdict != "pass")
        .group_by(ProbeResultRow.incident_id, ProbeResultRow.verdict)
    ).all()
    chosen: dict[int, tuple[bool, int]] = {}  # incident -> (its severity's verdict, result id)
    for incident_id, verdict, result_id in newest_by_verdict:
        rank = (verdict == SEVERITY_VERDICT.get(severities[int(incident_id)]), int(result_id))
        chosen[int(incident_id)] = max(chosen.get(int(incident_id), rank), rank)
    ids = [result_id for _, result_id in chosen.values()]
    rows = session.scalars(select(ProbeResultRow).where(ProbeResultRow.id.in_(ids))).all() if ids else []
    return {
        int(r.incident_id or 0): {
            "verdict": r.verdict,
            "reason": r.reason,
            "detail": r.detail,
            "prompt_tokens_sent": r.prompt_tokens_sent,
            "prompt_tokens_reported": r.prompt_tokens_reported,
            "status_code": r.status_code,
            "evidence": r.evidence,
        }
        for r in rows
    }
