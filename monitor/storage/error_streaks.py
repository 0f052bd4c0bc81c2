"""Runs of ``error`` results: when a streak began, and linking its rows to the warning it opened."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from kvcanary.monitor.storage.db import as_utc
from kvcanary.monitor.storage.models import ProbeResultRow


def error_streak(
    session: Session, *, target_id: int, probe: str, node: str = "", until: datetime
) -> tuple[datetime, int]:
    """Return when the current run of errors of (target, probe, node) began and how many it holds.

    The run is every ``error`` result after the last judged (non-error) result, up to ``until``
    inclusive. With no error in that range, return (``until``, 1): the result being recorded.
    """
    mine = (
        ProbeResultRow.target_id == target_id,
        ProbeResultRow.probe == probe,
        ProbeResultRow.node == node,
        ProbeResultRow.started_at <= until,
    )
    last_judged = session.execute(
        select(func.max(ProbeResultRow.started_at)).where(*mine, ProbeResultRow.verdict != "error")
    ).scalar_one_or_none()
    streak = select(func.min(ProbeResultRow.started_at), func.count()).where(
        *mine, ProbeResultRow.verdict == "error"
    )
    if last_judged is not None:
        streak = streak.where(ProbeResultRow.started_at > last_judged)
    first, count = session.execute(streak).one()
    return (as_utc(first) if first is not None else until), max(int(count), 1)


def link_errors(
    session: Session,
    *,
    target_id: int,
    probe: str,
    node: str = "",
    incident_id: int,
    since: datetime,
    until: datetime,
) -> None:
    """Link the unlinked error results of (target, probe, node) started in [since, until] to an incident."""
    session.execute(
        update(ProbeResultRow)
        .where(
            ProbeResultRow.target_id == target_id,
            ProbeResultRow.probe == probe,
            ProbeResultRow.node == node,
            ProbeResultRow.verdict == "error",
            ProbeResultRow.started_at >= since,
            ProbeResultRow.started_at <= until,
            ProbeResultRow.incident_id.is_(None),
        )
        .values(incident_id=incident_id),
        execution_options={"synchronize_session": False},
    )
