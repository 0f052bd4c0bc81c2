"""Retention: expired results deleted in batches, excerpts of target output purged before the rows."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.storage.db import as_utc
from kvcanary.monitor.storage.judged_rows import prune_judged
from kvcanary.monitor.storage.models import Incident, ProbeResultRow
from kvcanary.monitor.storage.traffic_rows import prune_traffic

#: Evidence keys whose values are (redacted) text a target returned: ``excerpt``, ``baseline_excerpt``.
EXCERPT_SUFFIX = "excerpt"


def has_excerpts(value: Any) -> bool:
    """Return True when ``value`` (evidence, as plain JSON) holds any excerpt of target output."""
    if isinstance(value, dict):
        return any(
            (k.endswith(EXCERPT_SUFFIX) and v not in (None, "")) or has_excerpts(v) for k, v in value.items()
        )
    if isinstance(value, list):
        return any(has_excerpts(v) for v in value)
    return False


def without_excerpts(evidence: dict[str, Any], note: str) -> dict[str, Any]:
    """Return ``evidence`` with every excerpt set to null and ``excerpts_note`` saying why."""
    return {**_drop_excerpts(evidence), "excerpts_note": note}


def _drop_excerpts(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: None if k.endswith(EXCERPT_SUFFIX) else _drop_excerpts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_drop_excerpts(v) for v in value]
    return value


def purge_excerpts(session: Session, *, now: datetime, batch: int = 500) -> int:
    """Drop the excerpts of up to ``batch`` results whose ``excerpts_until`` has passed; return how many.

    The rows stay (verdict, reason, figures, marker ids and hashes): only the text goes.
    """
    rows = session.execute(
        select(ProbeResultRow.id, ProbeResultRow.evidence, ProbeResultRow.excerpts_until)
        .where(ProbeResultRow.excerpts_until.is_not(None), ProbeResultRow.excerpts_until <= as_utc(now))
        .limit(batch)
    ).all()
    for row_id, evidence, until in rows:
        note = f"excerpts purged on {as_utc(until).date().isoformat()} (retention.excerpt_days)"
        session.execute(
            update(ProbeResultRow)
            .where(ProbeResultRow.id == row_id)
            .values(evidence=without_excerpts(evidence, note), excerpts_until=None),
            execution_options={"synchronize_session": False},
        )
    return len(rows)


def prune_expired(session: Session, *, now: datetime, batch: int | None = None) -> int:
    """Delete probe_result rows whose ``expires_at`` has passed; return how many were deleted.

    With ``batch``, delete at most that many: the caller commits between batches, so a large
    backlog never holds SQLite's one write lock (or PostgreSQL row locks) for long.

    Rows linked to an incident that is still open are kept, whatever their expiry: an open incident
    keeps all its evidence. Once it is resolved each linked row lives until its own expiry (failures
    were given the longer ``failure_days``). Events that pointed at a deleted row keep their
    verdict and reason; their ``probe_result_id`` becomes NULL (ON DELETE SET NULL).
    """
    still_open = select(Incident.id).where(Incident.state == "open")
    due = (
        ProbeResultRow.expires_at <= as_utc(now),
        (ProbeResultRow.incident_id.is_(None)) | (ProbeResultRow.incident_id.not_in(still_open)),
    )
    stmt = delete(ProbeResultRow)
    if batch is None:
        stmt = stmt.where(*due)
    else:
        first = select(ProbeResultRow.id).where(*due).limit(batch).scalar_subquery()
        stmt = stmt.where(ProbeResultRow.id.in_(first))
    result = session.execute(stmt, execution_options={"synchronize_session": False})
    return int(result.rowcount)  # type: ignore[attr-defined]


#: Rows deleted (or purged) per transaction: short write locks, even on a big backlog.
PRUNE_BATCH = 1000


def in_batches(session_factory: sessionmaker[Session], step: Callable[..., int]) -> int:
    """Run ``step`` (prune_expired, purge_excerpts) a batch per transaction until it is done;
    return how many rows it touched."""
    total = 0
    while True:
        with session_factory() as session, session.begin():
            done = step(session, now=datetime.now(UTC), batch=PRUNE_BATCH)
        total += done
        if done < PRUNE_BATCH:
            return total


def prune_round(
    session_factory: sessionmaker[Session], *, minute_days: float, judged_keep_seconds: float
) -> tuple[int, int]:
    """One round of retention, a batch per transaction: expired probe results deleted, expired
    excerpts purged, traffic minutes older than ``minute_days`` and judged ids older than
    ``judged_keep_seconds`` pruned. Return (results deleted, results whose excerpts were purged)."""
    removed = in_batches(session_factory, prune_expired)
    purged = in_batches(session_factory, purge_excerpts)
    in_batches(session_factory, partial(prune_traffic, minute_days=minute_days))
    in_batches(session_factory, partial(prune_judged, keep_seconds=judged_keep_seconds))
    return removed, purged
