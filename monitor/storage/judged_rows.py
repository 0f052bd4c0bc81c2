"""Record ids judged (``traffic_judged``): what makes a resend or a redelivery idempotent, for
traffic posted over HTTP and read from the JetStream stream alike (``monitor/traffic/pipeline.py``).

A mark is ``(partition, record id)``: the partition of the record's ``api_base``
(``kvcanary.wire.partition_of``, the stream's key) and the tap's id, one per exchange
(``kvcanary/tap/record.py``'s ``record_id``), never the engine's response id: engines repeat theirs,
and a second response under a seen id would be taken for a resend and never judged.

The pipeline asks which of a batch's marks are here already (one statement, :func:`judged_already`),
and inserts the rest in the transaction that stores their rows and counts, so a record is either
judged and marked or neither. Two replicas judging one record at once (a stream lease that lapsed
under a stalled owner) collide on the primary key: the later transaction fails, its messages are
not acknowledged, and their redelivery finds them marked.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import CursorResult, bindparam, delete, func, insert, select, text, tuple_
from sqlalchemy.orm import Session

from kvcanary.monitor.storage.db import UTCDateTime, as_utc
from kvcanary.monitor.storage.models import TrafficJudged

#: A judged record's key: (partition, record id).
Mark = tuple[int, str]
#: Marks asked about per statement on SQLite: two bound parameters each, well under its bound of
#: 32,766 (PostgreSQL takes them all as two arrays, whatever their number).
CHUNK = 4000
# PostgreSQL reads a batch's marks as two arrays: one statement whose text is the same for every
# batch (prepared once), where an IN list's text, and so its parsing, changes with each batch's size.
_PG_JUDGED = text(
    "SELECT j.partition, j.record_id FROM traffic_judged AS j"
    " JOIN unnest(CAST(:partitions AS integer[]), CAST(:record_ids AS varchar[])) AS m (p, r)"
    " ON j.partition = m.p AND j.record_id = m.r"
)
_PG_MARK = text(
    "INSERT INTO traffic_judged (partition, record_id, judged_at)"
    " SELECT p, r, :judged_at FROM unnest(CAST(:partitions AS integer[]), CAST(:record_ids AS varchar[]))"
    " AS m (p, r)"
).bindparams(bindparam("judged_at", type_=UTCDateTime()))


def judged_already(session: Session, marks: Sequence[Mark]) -> set[Mark]:
    """Return those of ``marks`` judged already: one statement (on SQLite, one per ``CHUNK``)."""
    if not marks:
        return set()
    if _on_postgresql(session):
        partitions, record_ids = _columns(marks)
        rows = session.execute(_PG_JUDGED, {"partitions": partitions, "record_ids": record_ids})
        return {(p, r) for p, r in rows}
    found: set[Mark] = set()
    key = tuple_(TrafficJudged.partition, TrafficJudged.record_id)
    for start in range(0, len(marks), CHUNK):
        query = select(TrafficJudged.partition, TrafficJudged.record_id).where(
            key.in_(marks[start : start + CHUNK])
        )
        found.update((p, r) for p, r in session.execute(query))
    return found


def mark_judged(session: Session, marks: Sequence[Mark], now: datetime) -> None:
    """Insert ``marks`` (one statement); a mark already there fails the transaction."""
    if not marks:
        return
    if _on_postgresql(session):
        partitions, record_ids = _columns(marks)
        session.execute(_PG_MARK, {"partitions": partitions, "record_ids": record_ids, "judged_at": now})
        return
    session.execute(
        insert(TrafficJudged), [{"partition": p, "record_id": r, "judged_at": now} for p, r in marks]
    )


def _on_postgresql(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _columns(marks: Sequence[Mark]) -> tuple[list[int], list[str]]:
    return [p for p, _ in marks], [r for _, r in marks]


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
