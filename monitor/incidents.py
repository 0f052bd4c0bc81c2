"""Record probe results and drive the incident lifecycle from them.

Probes compute, the runner records: :func:`record_result` is the recording. For one
(target, probe, node) — ``node`` is empty for probes that judge the whole target — the rules are:

- ``leak`` opens (or escalates to) a ``critical`` incident, ``mismatch`` a ``high`` one. At most
  one incident is open per (target, probe, node), across replicas too (a partial unique index);
  further failures attach to it, and a worse verdict escalates it. Severity never goes down.
- ``error`` (the probe could not judge) never counts as a leak or a mismatch and never as a pass.
  Errors with no judged result in between that last ``error_warning_after_seconds`` open a
  ``warning`` incident: the target is unmonitored, which is an availability problem, not a leak.
- ``pass`` counts towards resolution; ``resolve_after_passes`` passes in a row resolve the incident.
  A failure in between resets the count, so a flapping probe keeps ONE incident open.

Every state change is a compare-and-set UPDATE (``... WHERE id=:id AND state='open'``) and every
change writes an ``incident_event`` row; only the caller whose UPDATE matched writes it. The
caller owns the transaction: these functions flush, the caller commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import case, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from monitor.storage.db import as_utc, utcnow
from monitor.storage.models import Incident, IncidentEvent, ProbeResult
from monitor.storage.results import (
    error_streak,
    incident_title,
    link_errors,
    new_probe_result,
    upsert_target,
)

if TYPE_CHECKING:
    from sqlalchemy import Row

    from monitor.config import IncidentConfig, RetentionConfig
    from probes.base import ProbeResult as ProbeOutcome

#: Severity opened by each failing verdict; errors open ``warning`` (see module docstring).
SEVERITY_FOR = {"leak": "critical", "mismatch": "high", "error": "warning"}
_RANK = {"warning": 0, "high": 1, "critical": 2}
# Opening can lose a race (another replica opened first) and attaching can lose one (the incident
# was resolved in between); each loss means the next attempt sees the winner's row.
_ATTEMPTS = 3

Change = Literal["opened", "escalated", "attached", "resolved"]


@dataclass(frozen=True)
class RecordOutcome:
    """What recording one result did.

    ``incident_id`` is the incident the result was linked to (None: none was open).
    ``change`` is what happened to it: ``opened``, ``escalated``, ``attached`` (a failure counted),
    ``resolved``, or None (nothing: a pass while none is open, a pass or error that only counted).
    ``severity`` is the incident's severity afterwards, None without an incident.
    """

    result_id: int
    incident_id: int | None
    change: Change | None
    severity: str | None
    # Which target row the result went to (for the state stored beside it); not part of "what changed".
    target_id: int = field(default=0, compare=False)


@dataclass
class _Recording:
    """One result being recorded: its row and what the rules need to know about it."""

    row: ProbeResult
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

    def outcome(self, incident_id: int | None, change: Change | None, severity: str | None) -> RecordOutcome:
        self.row.incident_id = incident_id
        return RecordOutcome(self.row.id, incident_id, change, severity, self.target_id)


def record_result(
    session: Session,
    *,
    target_name: str,
    engine: str,
    base_url: str,
    model: str,
    probe: str,
    result: ProbeOutcome,
    started_at: datetime,
    duration_seconds: float,
    policy: IncidentConfig,
    retention: RetentionConfig,
    now: datetime | None = None,
    node: str = "",
) -> RecordOutcome:
    """Store ``result`` for (``target_name``, ``probe``) and apply the incident rules; flush, don't commit.

    Upsert the target row (its ``base_url`` stored without credentials), insert the probe_result
    with ``expires_at`` = ``started_at`` + ``retention.pass_days`` for a pass, else
    ``retention.failure_days``, then open, attach, escalate or resolve as the module docstring says.
    ``now`` (default: the current time) stamps incident changes and events. ``node`` scopes the
    result and its incident to one node of the target (empty: the target as a whole).
    Raise ValueError for a verdict outside pass|leak|mismatch|error.
    """
    now = as_utc(now) if now is not None else utcnow()
    row = new_probe_result(
        probe=probe,
        node=node,
        result=result,
        started_at=as_utc(started_at),
        duration_seconds=duration_seconds,
        retention=retention,
    )
    target_id = upsert_target(
        session, name=target_name, engine=engine, base_url=base_url, model=model, now=now
    )
    row.target_id = target_id
    session.add(row)
    session.flush()
    rec = _Recording(row, target_id, target_name, probe, now)
    if row.verdict == "pass":
        outcome = _on_pass(session, rec, policy)
    elif row.verdict == "error":
        outcome = _on_error(session, rec, policy)
    else:
        outcome = _on_failure(session, rec, SEVERITY_FOR[row.verdict])
    session.flush()
    return outcome


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


# --- the rules ------------------------------------------------------------------------------------


def _on_failure(session: Session, rec: _Recording, severity: str) -> RecordOutcome:
    """Open an incident of ``severity`` or count the failure against the open one (escalating it)."""
    for _ in range(_ATTEMPTS):
        current = _open_incident(session, rec)
        if current is None:
            opened = _try_open(
                session, rec, severity, title=incident_title(rec.row, rec.target_name, severity)
            )
            if opened is not None:
                return rec.outcome(opened, "opened", severity)
        else:
            attached = _attach(session, rec, current, severity)
            if attached is not None:
                return attached
    raise RuntimeError(f"could not open or attach an incident for {rec.target_name}/{rec.probe}")


def _attach(session: Session, rec: _Recording, current: Row[Any], severity: str) -> RecordOutcome | None:
    """Count a failure of ``severity`` against the open incident ``current``, escalating it if worse.

    Return None when the incident was resolved since it was read.
    """
    counted = _count_failure(session, rec, current.id)
    if counted is None:
        return None
    if _RANK[severity] > _RANK[counted] and _escalate(session, rec, current.id, counted, severity):
        return rec.outcome(current.id, "escalated", severity)
    if current.consecutive_passes > 0 or (
        current.last_reason != rec.reason and current.last_verdict != "error"
    ):
        # A relapse after passes, or a new kind of failure: worth a row in the timeline.
        # Repeats of the same failure only bump failure_count.
        _event(session, rec, current.id, "failure", old=counted, new=counted)
    return rec.outcome(current.id, "attached", counted)


def _on_pass(session: Session, rec: _Recording, policy: IncidentConfig) -> RecordOutcome:
    """Count a pass against the open incident and resolve it after enough passes in a row."""
    current = _open_incident(session, rec)
    if current is None:
        return rec.outcome(None, None, None)
    stmt = (
        update(Incident)
        .where(Incident.id == current.id, Incident.state == "open")
        .values(
            consecutive_passes=Incident.consecutive_passes + 1,
            last_verdict=rec.verdict,
            last_reason=rec.reason,
        )
        .returning(Incident.consecutive_passes, Incident.severity)
    )
    counted = session.execute(stmt).one_or_none()
    if counted is None:
        return rec.outcome(None, None, None)  # resolved by someone else since we looked
    passes, severity = counted
    if passes >= policy.resolve_after_passes and resolve_incident(
        session,
        incident_id=current.id,
        now=rec.now,
        probe_result_id=rec.row.id,
        verdict=rec.verdict,
        reason=rec.reason,
    ):
        return rec.outcome(current.id, "resolved", severity)
    return rec.outcome(current.id, None, severity)


def _on_error(session: Session, rec: _Recording, policy: IncidentConfig) -> RecordOutcome:
    """Link an error to the open incident, or open a warning when errors have lasted long enough."""
    streak: tuple[datetime, int] | None = None
    for _ in range(_ATTEMPTS):
        current = _open_incident(session, rec)
        if current is not None:
            linked = _error_against(session, rec, current)
            if linked is not None:
                return linked
            continue
        if streak is None:
            streak = error_streak(
                session, target_id=rec.target_id, probe=rec.probe, node=rec.node, until=rec.started_at
            )
        first_error_at, errors = streak
        lasted = (rec.started_at - first_error_at).total_seconds()
        if lasted < policy.error_warning_after_seconds:
            return rec.outcome(None, None, None)
        title = incident_title(rec.row, rec.target_name, "warning", lasted)
        opened = _try_open(session, rec, "warning", title=title, failure_count=errors)
        if opened is not None:
            link_errors(
                session,
                target_id=rec.target_id,
                probe=rec.probe,
                node=rec.node,
                incident_id=opened,
                since=first_error_at,
                until=rec.started_at,
            )
            return rec.outcome(opened, "opened", "warning")
    raise RuntimeError(f"could not open a warning incident for {rec.target_name}/{rec.probe}")


def _error_against(session: Session, rec: _Recording, current: Row[Any]) -> RecordOutcome | None:
    """Record an error against the open incident; None when it was resolved since it was read.

    Against a ``warning`` incident (itself about errors) an error is a failure: it counts and resets
    the passes. Against a leak or mismatch incident it is neither a failure nor a pass.
    """
    if current.severity == "warning":
        return _attach(session, rec, current, "warning")
    stmt = (
        update(Incident)
        .where(Incident.id == current.id, Incident.state == "open")
        .values(last_verdict=rec.verdict, last_reason=rec.reason)
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return None
    return rec.outcome(current.id, None, current.severity)


# --- statements -----------------------------------------------------------------------------------


def _open_incident(session: Session, rec: _Recording) -> Row[Any] | None:
    query = select(
        Incident.id,
        Incident.severity,
        Incident.consecutive_passes,
        Incident.last_verdict,
        Incident.last_reason,
    ).where(
        Incident.target_id == rec.target_id,
        Incident.probe == rec.probe,
        Incident.node == rec.node,
        Incident.state == "open",
    )
    return session.execute(query).one_or_none()


def _try_open(
    session: Session, rec: _Recording, severity: str, *, title: str, failure_count: int = 1
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
        failure_count=failure_count,
        consecutive_passes=0,
        last_verdict=rec.verdict,
        last_reason=rec.reason,
    )
    try:
        with session.begin_nested():
            session.add(incident)
    except IntegrityError:
        return None
    _event(session, rec, incident.id, "opened", old=None, new=severity)
    return incident.id


def _count_failure(session: Session, rec: _Recording, incident_id: int) -> str | None:
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


def _escalate(session: Session, rec: _Recording, incident_id: int, old: str, new: str) -> bool:
    """Raise the severity from ``old`` to ``new`` by compare-and-set; write the event if we did."""
    stmt = (
        update(Incident)
        .where(Incident.id == incident_id, Incident.state == "open", Incident.severity == old)
        .values(severity=new, title=incident_title(rec.row, rec.target_name, new))
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return False
    _event(session, rec, incident_id, "escalated", old=old, new=new)
    return True


def _event(
    session: Session, rec: _Recording, incident_id: int, kind: str, *, old: str | None, new: str
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
