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
- An incident is as ``certain`` as its surest failure (``probes/base.py``): one opened by a
  ``suspected`` failure becomes ``certain`` (``proven``) when a certain one joins it. An operator
  may ``confirm`` a suspected incident (containment then acts on it) or ``dismiss`` it as benign
  (it resolves); neither applies to a certain one.

Every state change is a compare-and-set statement (``monitor/storage/incident_rows.py``) and every
change writes an ``incident_event`` row; only the caller whose UPDATE matched writes it. The
caller owns the transaction: these functions flush, the caller commits.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kvcanary.monitor.storage.db import as_utc, utcnow
from kvcanary.monitor.storage.error_streaks import error_streak, link_errors
from kvcanary.monitor.storage.incident_rows import (
    Recording,
    RecordOutcome,
    count_failure,
    escalate,
    event,
    open_incident,
    prove,
    resolve_incident,
    try_open,
)
from kvcanary.monitor.storage.models import Incident, IncidentEvent
from kvcanary.monitor.storage.result_rows import incident_title, new_probe_result
from kvcanary.monitor.storage.target_rows import upsert_target

if TYPE_CHECKING:
    from sqlalchemy import Row

    from kvcanary.monitor.config.settings import IncidentConfig, RetentionConfig
    from kvcanary.probes.base import ProbeResult as ProbeOutcome

#: Severity opened by each failing verdict; errors open ``warning`` (see module docstring).
SEVERITY_FOR = {"leak": "critical", "mismatch": "high", "error": "warning"}
_RANK = {"warning": 0, "high": 1, "critical": 2}
#: What an event's note keeps of an operator's words or a verification's summary.
NOTE_CHARS = 300
# Opening can lose a race (another replica opened first) and attaching can lose one (the incident
# was resolved in between); each loss means the next attempt sees the winner's row.
_ATTEMPTS = 3

__all__ = [
    "SEVERITY_FOR",
    "NotSuspected",
    "RecordOutcome",
    "confirm",
    "dismiss",
    "note_config_change",
    "record_result",
    "resolve_incident",
]


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
    target_id: int | None = None,
) -> RecordOutcome:
    """Store ``result`` for (``target_name``, ``probe``) and apply the incident rules; flush, don't commit.

    Upsert the target row (its ``base_url`` stored without credentials), insert the probe_result
    with ``expires_at`` = ``started_at`` + ``retention.pass_days`` for a pass, else
    ``retention.failure_days``, then open, attach, escalate or resolve as the module docstring says.
    ``now`` (default: the current time) stamps incident changes and events. ``node`` scopes the
    result and its incident to one node of the target (empty: the target as a whole). A known
    ``target_id`` (of a target row with these very values) skips the upsert.
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
    if target_id is None:
        target_id = upsert_target(
            session, name=target_name, engine=engine, base_url=base_url, model=model, now=now
        )
    row.target_id = target_id
    session.add(row)
    session.flush()
    rec = Recording(row, target_id, target_name, probe, now)
    if row.verdict == "pass":
        outcome = _on_pass(session, rec, policy)
    elif row.verdict == "error":
        outcome = _on_error(session, rec, policy)
    else:
        outcome = _on_failure(session, rec, SEVERITY_FOR[row.verdict])
    session.flush()
    return outcome


def note_config_change(session: Session, *, target_id: int, result_id: int, now: datetime) -> int:
    """Put a node's configuration change in the timeline of every open incident of its target.

    A change of weights, parallelism or memory fraction can explain a failure or fix it, on any
    node of the target: the on-call person reading an incident must see when the deployment moved.
    It changes no incident's state, so it pages nobody (the event is born delivered). The change
    itself (what moved, before and after) is in the capacity result ``result_id`` points at.
    Return how many incidents noted it.
    """
    rows = session.execute(
        select(Incident.id, Incident.severity).where(
            Incident.target_id == target_id, Incident.state == "open"
        )
    ).all()
    for incident_id, severity in rows:
        session.add(
            IncidentEvent(
                incident_id=incident_id,
                kind="config_changed",
                created_at=now,
                old_state="open",
                new_state="open",
                old_severity=severity,
                new_severity=severity,
                reason="config_changed",
                probe_result_id=result_id,
                processed_at=now,
            )
        )
    return len(rows)


class NotSuspected(Exception):
    """The incident is not an open suspected one: an operator's word does not apply to it.

    ``state`` and ``certainty`` are what it is instead (None: no such incident)."""

    def __init__(self, incident_id: int, state: str | None, certainty: str | None):
        self.incident_id, self.state, self.certainty = incident_id, state, certainty
        what = "no such incident" if state is None else f"it is {state} and {certainty}"
        super().__init__(f"incident {incident_id}: {what}, not an open suspected one")


def confirm(session: Session, *, incident_id: int, note: str, now: datetime) -> None:
    """Confirm an open suspected incident as a real leak: containment acts on it from now on.
    The ``confirmed`` event pages (the alert's certainty changes). Raise :class:`NotSuspected`."""
    stmt = (
        update(Incident)
        .where(Incident.id == incident_id, Incident.state == "open", Incident.certainty == "suspected")
        .values(certainty="confirmed")
        .returning(Incident.severity)
    )
    severity = session.execute(stmt).scalar_one_or_none()
    if severity is None:
        raise _not_suspected(session, incident_id)
    _operator_event(session, incident_id, "confirmed", "open", severity, note, now)


def dismiss(session: Session, *, incident_id: int, note: str, now: datetime) -> None:
    """Resolve an open suspected incident as benign (a text the customers share, not a leak); the
    ``dismissed`` event pages its resolution. Raise :class:`NotSuspected`."""
    stmt = (
        update(Incident)
        .where(Incident.id == incident_id, Incident.state == "open", Incident.certainty == "suspected")
        .values(state="resolved", resolved_at=now)
        .returning(Incident.severity)
    )
    severity = session.execute(stmt).scalar_one_or_none()
    if severity is None:
        raise _not_suspected(session, incident_id)
    _operator_event(session, incident_id, "dismissed", "resolved", severity, note, now)


def _not_suspected(session: Session, incident_id: int) -> NotSuspected:
    found = session.execute(
        select(Incident.state, Incident.certainty).where(Incident.id == incident_id)
    ).one_or_none()
    return NotSuspected(incident_id, *(found or (None, None)))


def _operator_event(
    session: Session, incident_id: int, kind: str, state: str, severity: str, note: str, now: datetime
) -> None:
    session.add(
        IncidentEvent(
            incident_id=incident_id, kind=kind, created_at=now, old_state="open", new_state=state,
            old_severity=severity, new_severity=severity, reason=f"operator_{kind}",
            note=note[:NOTE_CHARS], processed_at=None,
        )
    )  # fmt: skip


# --- the rules ------------------------------------------------------------------------------------


def _on_failure(session: Session, rec: Recording, severity: str) -> RecordOutcome:
    """Open an incident of ``severity`` or count the failure against the open one (escalating it)."""
    for _ in range(_ATTEMPTS):
        current = open_incident(session, rec)
        if current is None:
            opened = try_open(
                session, rec, severity, title=incident_title(rec.row, rec.target_name, severity)
            )
            if opened is not None:
                return rec.outcome(opened, "opened", severity)
        else:
            attached = _attach(session, rec, current, severity)
            if attached is not None:
                return attached
    raise RuntimeError(f"could not open or attach an incident for {rec.target_name}/{rec.probe}")


def _attach(session: Session, rec: Recording, current: Row[Any], severity: str) -> RecordOutcome | None:
    """Count a failure of ``severity`` against the open incident ``current``, escalating it if worse.

    Return None when the incident was resolved since it was read.
    """
    counted = count_failure(session, rec, current.id)
    if counted is None:
        return None
    proven = current.certainty == "suspected" and rec.certainty == "certain"
    proven = proven and prove(session, rec, current.id, counted)
    if _RANK[severity] > _RANK[counted] and escalate(session, rec, current.id, counted, severity):
        return rec.outcome(current.id, "escalated", severity)
    if proven:
        return rec.outcome(current.id, "proven", counted)
    if current.consecutive_passes > 0 or (
        current.last_reason != rec.reason and current.last_verdict != "error"
    ):
        # A relapse after passes, or a new kind of failure: worth a row in the timeline.
        # Repeats of the same failure only bump failure_count.
        event(session, rec, current.id, "failure", old=counted, new=counted)
    return rec.outcome(current.id, "attached", counted)


def _on_pass(session: Session, rec: Recording, policy: IncidentConfig) -> RecordOutcome:
    """Count a pass against the open incident and resolve it after enough passes in a row."""
    current = open_incident(session, rec)
    if current is None:
        return rec.outcome(None, None, None)
    stmt = (
        update(Incident)
        # A pass that started before the last failure (replayed from a spool, or run by a replica
        # that had not yet seen the failure) says nothing about now: it must not count toward resolving.
        .where(Incident.id == current.id, Incident.state == "open", Incident.last_failure_at < rec.started_at)
        .values(
            consecutive_passes=Incident.consecutive_passes + 1,
            last_verdict=rec.verdict,
            last_reason=rec.reason,
        )
        .returning(Incident.consecutive_passes, Incident.severity)
    )
    counted = session.execute(stmt).one_or_none()
    if counted is None:
        return rec.outcome(None, None, None)  # resolved by someone else since we looked, or stale
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


def _on_error(session: Session, rec: Recording, policy: IncidentConfig) -> RecordOutcome:
    """Link an error to the open incident, or open a warning when errors have lasted long enough."""
    streak: tuple[datetime, int] | None = None
    for _ in range(_ATTEMPTS):
        current = open_incident(session, rec)
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
        opened = try_open(session, rec, "warning", title=title, failure_count=errors)
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


def _error_against(session: Session, rec: Recording, current: Row[Any]) -> RecordOutcome | None:
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
