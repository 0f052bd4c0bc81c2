"""The compare-and-set statements behind the incident lifecycle (``monitor/incidents.py`` has the rules).

Every state change is an ``UPDATE … WHERE id=:id AND state='open'`` (or an INSERT guarded by the
partial unique index), and only the caller whose statement matched writes the ``incident_event``
row. The caller owns the transaction: these functions flush, the caller commits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Row, case, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kvcanary.monitor.storage.models import Incident, IncidentEvent, ProbeResultRow, Target
from kvcanary.monitor.storage.result_rows import incident_title

Change = Literal["opened", "escalated", "proven", "attached", "resolved"]


@dataclass(frozen=True)
class RecordOutcome:
    """What recording one result did.

    ``incident_id`` is the incident the result was linked to (None: none was open).
    ``change`` is what happened to it: ``opened``, ``escalated``, ``proven`` (a certain failure
    joined a suspected incident), ``attached`` (a failure counted), ``resolved``, or None
    (nothing: a pass while none is open, a pass or error that only counted).
    ``severity`` is the incident's severity afterwards, None without an incident.
    """

    result_id: int
    incident_id: int | None
    change: Change | None
    severity: str | None
    # Which target row the result went to (for the state stored beside it); not part of "what changed".
    target_id: int = field(default=0, compare=False)


@dataclass
class Recording:
    """One result being recorded: its row and what the rules need to know about it."""

    row: ProbeResultRow
    target_id: int
    target_name: str
    probe: str
    now: datetime

    @property
    def node(self) -> str:
        return self.row.node

    @property
    def verdict(self) -> str:
        return self.row.verdict

    @property
    def reason(self) -> str:
        return self.row.reason

    @property
    def started_at(self) -> datetime:
        return self.row.started_at

    @property
    def certainty(self) -> str:
        """How the failure is known; an error (a warning incident's) is a fact: ``certain``."""
        return self.row.certainty or "certain"

    def outcome(self, incident_id: int | None, change: Change | None, severity: str | None) -> RecordOutcome:
        self.row.incident_id = incident_id
        return RecordOutcome(self.row.id, incident_id, change, severity, self.target_id)


def resolve_incident(
    session: Session,
    *,
    incident_id: int,
    now: datetime,
    probe_result_id: int | None = None,
    verdict: str | None = None,
    reason: str | None = None,
) -> bool:
    """Resolve the incident if it is still open; return True only for the caller that resolved it.

    The compare-and-set ``UPDATE incident SET state='resolved' ... WHERE id=:id AND state='open'``
    matches for one caller at most, and only that caller writes the ``resolved`` event.
    """
    stmt = (
        update(Incident)
        .where(Incident.id == incident_id, Incident.state == "open")
        .values(state="resolved", resolved_at=now)
        .returning(Incident.severity)
    )
    severity = session.execute(stmt).scalar_one_or_none()
    if severity is None:
        # Nothing matched: already resolved, by another replica or an earlier call.
        return False
    event = IncidentEvent(
        incident_id=incident_id,
        kind="resolved",
        created_at=now,
        old_state="open",
        new_state="resolved",
        old_severity=severity,
        new_severity=severity,
        verdict=verdict,
        reason=reason,
        probe_result_id=probe_result_id,
        processed_at=None,
    )
    session.add(event)
    return True


def open_incident(session: Session, rec: Recording) -> Row[Any] | None:
    query = select(
        Incident.id,
        Incident.severity,
        Incident.consecutive_passes,
        Incident.last_verdict,
        Incident.last_reason,
        Incident.certainty,
    ).where(
        Incident.target_id == rec.target_id,
        Incident.probe == rec.probe,
        Incident.node == rec.node,
        Incident.state == "open",
    )
    return session.execute(query).one_or_none()


def open_incident_keys(session: Session, target_ids: Iterable[int]) -> set[tuple[int, str, str]]:
    """Return (target_id, probe, node) of every open incident of these targets: one query for a batch."""
    ids = sorted(set(target_ids))
    if not ids:
        return set()
    query = select(Incident.target_id, Incident.probe, Incident.node).where(
        Incident.state == "open", Incident.target_id.in_(ids)
    )
    return {(t, p, n) for t, p, n in session.execute(query)}


def open_incident_counts(session: Session) -> list[tuple[str, str, str, str, str, int]]:
    """Return ``(target_name, probe, node, severity, certainty, count)`` for every open incident group.

    Groups with nothing open are absent; the metrics collector exports them as 0.
    """
    columns = (Target.name, Incident.probe, Incident.node, Incident.severity, Incident.certainty)
    query = (
        select(*columns, func.count())
        .join(Target, Target.id == Incident.target_id)
        .where(Incident.state == "open")
        .group_by(*columns)
        .order_by(*columns)
    )
    return [
        (name, probe, node, sev, how, int(n)) for name, probe, node, sev, how, n in session.execute(query)
    ]


def try_open(
    session: Session, rec: Recording, severity: str, *, title: str, failure_count: int = 1
) -> int | None:
    """Insert an open incident and its ``opened`` event; return its id, or None when one is open already.

    The partial unique index ``uq_incident_open_target_probe_node`` decides races between replicas:
    the loser's INSERT fails, and only its SAVEPOINT is rolled back (the result row stays).
    """
    incident = Incident(
        target_id=rec.target_id,
        probe=rec.probe,
        node=rec.node,
        severity=severity,
        state="open",
        title=title,
        opened_at=rec.now,
        last_failure_at=rec.started_at,
        resolved_at=None,
        last_pass_at=last_pass_before(session, rec),
        failure_count=failure_count,
        consecutive_passes=0,
        last_verdict=rec.verdict,
        last_reason=rec.reason,
        certainty=rec.certainty,
    )
    try:
        with session.begin_nested():
            session.add(incident)
    except IntegrityError:
        return None
    event(session, rec, incident.id, "opened", old=None, new=severity)
    return incident.id


def last_pass_before(session: Session, rec: Recording) -> datetime | None:
    """Return when (target, probe, node) last passed before ``rec``: one index range read, newest
    first (``ix_probe_result_target_probe_started_id``), at the opening of an incident only."""
    query = (
        select(ProbeResultRow.started_at)
        .where(
            ProbeResultRow.target_id == rec.target_id,
            ProbeResultRow.probe == rec.probe,
            ProbeResultRow.node == rec.node,
            ProbeResultRow.verdict == "pass",
            ProbeResultRow.started_at < rec.started_at,
        )
        .order_by(ProbeResultRow.started_at.desc(), ProbeResultRow.id.desc())
        .limit(1)
    )
    return session.execute(query).scalar_one_or_none()


def count_failure(session: Session, rec: Recording, incident_id: int) -> str | None:
    """Count a failure against an open incident; return its severity, or None if it is no longer open."""
    latest = case((Incident.last_failure_at < rec.started_at, rec.started_at), else_=Incident.last_failure_at)
    stmt = (
        update(Incident)
        .where(Incident.id == incident_id, Incident.state == "open")
        .values(
            failure_count=Incident.failure_count + 1,
            consecutive_passes=0,
            last_failure_at=latest,
            last_verdict=rec.verdict,
            last_reason=rec.reason,
        )
        .returning(Incident.severity)
    )
    return session.execute(stmt).scalar_one_or_none()


def escalate(session: Session, rec: Recording, incident_id: int, old: str, new: str) -> bool:
    """Raise the severity from ``old`` to ``new`` by compare-and-set; write the event if we did."""
    stmt = (
        update(Incident)
        .where(Incident.id == incident_id, Incident.state == "open", Incident.severity == old)
        .values(severity=new, title=incident_title(rec.row, rec.target_name, new))
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return False
    event(session, rec, incident_id, "escalated", old=old, new=new)
    return True


def prove(session: Session, rec: Recording, incident_id: int, severity: str) -> bool:
    """Mark a suspected incident ``certain`` by compare-and-set, ``rec`` (a certain failure) its proof;
    write the ``proven`` event if we did (it pages: the alert's certainty changes)."""
    stmt = (
        update(Incident)
        .where(Incident.id == incident_id, Incident.state == "open", Incident.certainty == "suspected")
        .values(certainty="certain")
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return False
    event(session, rec, incident_id, "proven", old=severity, new=severity)
    return True


def event(
    session: Session, rec: Recording, incident_id: int, kind: str, *, old: str | None, new: str
) -> None:
    """Add an event caused by ``rec`` to an open incident; ``old``/``new`` are the severities."""
    event = IncidentEvent(
        incident_id=incident_id,
        kind=kind,
        created_at=rec.now,
        old_state=None if kind == "opened" else "open",
        new_state="open",
        old_severity=old,
        new_severity=new,
        verdict=rec.verdict,
        reason=rec.reason,
        probe_result_id=rec.row.id,
        processed_at=None,
    )
    session.add(event)
