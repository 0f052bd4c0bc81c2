"""The traffic the monitor recorded: its kept rows (every flagged record, and every record near or
over its node's pool) and, for counts of every request, its per-minute aggregates.

Every count is one grouped SQL statement over an index range (``target_id, started_at``), so a
blast radius over millions of kept rows reads only the target's window. The monitor's own
tenants' records are kept and counted apart (``own``, or a key hash of a tenant's key today).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, and_, cast, func, or_, select
from sqlalchemy.orm import Session

from monitor.blast.question import Scope
from monitor.blast.tally import Tally
from monitor.storage.models import TrafficMinute, TrafficRecordRow

R, M = TrafficRecordRow, TrafficMinute


def _epoch(column: Any) -> Any:
    return cast(func.extract("epoch", column), BigInteger)


def _bucket(scope: Scope, column: Any) -> Any:
    return (_epoch(column) - int(scope.start_epoch)) // scope.bucket_seconds


def _nodes(scope: Scope, column: Any) -> Any:
    # Traffic through the target's front door ("") can reach any node; a node's own URL, only it.
    return True if not scope.node else column.in_(["", scope.node])


def recorded_tally(session: Session, scope: Scope) -> Tally:
    tally = Tally("recorded traffic", "the monitor's traffic_record rows and traffic_minute counts")
    in_window = [
        M.target_id == scope.target_id,
        _nodes(scope, M.node),
        M.minute >= scope.window.start.at.replace(second=0, microsecond=0),
        M.minute <= scope.window.end.at,
    ]
    records = session.execute(select(func.sum(M.records)).where(*in_window)).scalar_one_or_none()
    tally.rows_read = int(records or 0)
    tally.covered = tally.rows_read > 0
    if not tally.covered:
        tally.notes.append("the gateway tap delivered no record of this target in the window")
    kind = scope.criterion.kind
    if kind == "at_risk":
        tally.add_groups(_minute_groups(session, scope, in_window))
        tally.notes.append(
            "requests outside the kept rows are counted by the minute: first and last are minutes"
        )
    elif kind in ("over_pool", "flagged"):
        tally.add_groups(_row_groups(session, scope))
    return tally


def _own(scope: Scope) -> Any:
    keys = sorted(scope.own_keys)
    return or_(R.own, R.key_hash.in_(keys)) if keys else R.own


def row_filter(scope: Scope) -> list[Any]:
    """The kept rows the criterion names (also what the CSV lists)."""
    where = [
        R.target_id == scope.target_id,
        _nodes(scope, R.node),
        R.started_at >= scope.window.start.at,
        R.started_at <= scope.window.end.at,
    ]
    criterion = scope.criterion
    if criterion.kind == "over_pool":
        where += [
            R.status_code >= 200,
            R.status_code < 300,
            R.estimated_prompt_tokens > criterion.pool_tokens,
        ]
    else:
        where.append(R.checks.like(f"%,{criterion.check},%"))
    return where


def _row_groups(session: Session, scope: Scope) -> list[tuple[Any, ...]]:
    own = _own(scope).label("own")
    bucket = _bucket(scope, R.started_at).label("bucket")
    query = (
        select(
            R.caller,
            own,
            bucket,
            func.count(),
            func.min(_epoch(R.started_at)),
            func.max(_epoch(R.started_at)),
        )
        .where(*row_filter(scope))
        .group_by(R.caller, own, bucket)
    )
    return [tuple(row) for row in session.execute(query)]


def _minute_groups(session: Session, scope: Scope, in_window: list[Any]) -> list[tuple[Any, ...]]:
    bucket = _bucket(scope, M.minute).label("bucket")
    first, last = func.min(_epoch(M.minute)), func.max(_epoch(M.minute))
    query = (
        select(M.caller, bucket, func.sum(M.answered - M.own), func.sum(M.own), first, last)
        .where(*in_window)
        .group_by(M.caller, bucket)
    )
    out: list[tuple[Any, ...]] = []
    for caller, b, theirs, own, lo, hi in session.execute(query):
        out += [(caller, False, b, theirs, lo, hi)] if theirs else []
        out += [(caller, True, b, own, lo, hi)] if own else []
    return out


def recorded_requests(session: Session, scope: Scope, limit: int) -> list[tuple[str, str, bool, float]]:
    """Return ``(request id, caller, own, epoch)`` of the kept rows that match, oldest first."""
    if scope.criterion.kind not in ("over_pool", "flagged"):
        return []
    query = (
        select(R.request_id, R.caller, _own(scope), _epoch(R.started_at))
        .where(and_(*row_filter(scope)))
        .order_by(R.started_at, R.id)
        .limit(limit)
    )
    return [(rid, caller, bool(own), float(t)) for rid, caller, own, t in session.execute(query)]
