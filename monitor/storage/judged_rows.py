"""Record ids judged from the JetStream stream (``traffic_judged``): what makes a redelivery idempotent.

The consumer asks which of a pulled batch's ids were judged already (one indexed read), and marks
the rest in the transaction that stores their rows and counts (``TrafficIngest``), so a record is
either judged and marked or neither. Two replicas judging one record at once (a lease that lapsed
under a stalled owner) collide on the primary key: the later transaction fails, its messages are
not acknowledged, and their redelivery finds them marked.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import CursorResult, delete, func, insert, select
from sqlalchemy.orm import Session

from monitor.storage.db import as_utc
from monitor.storage.models import TrafficJudged

#: Ids asked about per statement (well under every backend's bound on bound parameters).
CHUNK = 500


def judged_already(session: Session, partition: int, record_ids: Iterable[str]) -> set[str]:
    """Return those of ``record_ids`` judged already in ``partition``."""
    ids = list(dict.fromkeys(record_ids))
    found: set[str] = set()
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        query = select(TrafficJudged.record_id).where(
            TrafficJudged.partition == partition, TrafficJudged.record_id.in_(chunk)
        )
        found.update(session.scalars(query))
    return found


def mark_judged(session: Session, marks: Iterable[tuple[int, str]], now: datetime) -> None:
    """Insert ``(partition, record id)`` marks; a mark already there fails the transaction."""
    rows = [{"partition": p, "record_id": r, "judged_at": now} for p, r in marks]
    if rows:
        session.execute(insert(TrafficJudged), rows)


def prune_judged(session: Session, *, now: datetime, batch: int | None = None, keep_seconds: float) -> int:
    """Delete marks older than ``keep_seconds`` before the newest (or ``now``, if earlier); at most
    ``batch`` a call (``retention.in_batches``).

    Counted from the newest mark, not the clock: after every replica was down longer than that,
    the records judged just before the outage but not acknowledged come again first thing, and
    their marks must still be there then; the clock alone would prune them at the first pass.
    """
    newest = session.scalar(select(func.max(TrafficJudged.judged_at)))
    if newest is None:
        return 0
    old = TrafficJudged.judged_at < min(now, as_utc(newest)) - timedelta(seconds=keep_seconds)
    if batch is None:
        result = session.execute(delete(TrafficJudged).where(old))
    else:
        keys = select(TrafficJudged.partition, TrafficJudged.record_id).where(old).limit(batch)
        doomed = [tuple(row) for row in session.execute(keys)]
        if not doomed:
            return 0
        result = session.execute(
            delete(TrafficJudged).where(
                TrafficJudged.partition.in_({p for p, _ in doomed}),
                TrafficJudged.record_id.in_({r for _, r in doomed}),
                old,
            )
        )
    return result.rowcount if isinstance(result, CursorResult) else 0
