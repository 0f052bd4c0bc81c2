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

from kvcanary.monitor.blast.question import Scope
from kvcanary.monitor.blast.source import RequestRow, Tally
from kvcanary.monitor.storage.models import TrafficMinute, TrafficRecordRow

R, M = TrafficRecordRow, TrafficMinute


def _epoch(column: Any) -> Any:
    return cast(func.extract("epoch", column), BigInteger)


def _bucket(scope: Scope, column: Any) -> Any:
    return (_epoch(column) - int(scope.start_epoch)) // scope.bucket_seconds


def _nodes(scope: Scope, column: Any) -> Any:
    # Traffic through the target's front door ("") can reach any node; a node's own URL, only it.
    return True if not scope.node else column.in_(["", scope.node])


class RecordedTraffic:
    """The traffic the gateway tap delivered, as the monitor kept it (a ``BlastSource``).

    Trusted least of the sources: it holds only what the tap saw, and for at-risk counts only
    minutes, but it is the one source every monitor has.
    """

    name = "recorded traffic"
    about = "what the gateway tap delivered: the monitor's kept traffic_record rows and traffic_minute counts"
    trust = 1

    def __repr__(self) -> str:
        return "RecordedTraffic()"

    def tally(self, session: Session, scope: Scope) -> Tally:
        tally = Tally(self.name, "the monitor's traffic_record rows and traffic_minute counts", source=self)
        in_window = [
            M.target_id == scope.target_id,
            _nodes(scope, M.node),
            M.minute >= scope.window.start.at.replace(second=0, microsecond=0),
            M.minute <= scope.window.end.at,
        ]
        records = session.execute(select(func.sum(M.records)).where(*in_window)).scalar_one_or_none()
        tally.rows_read = int(records or 0)
        tally.covered = tally.rows_read > 0
        tally.span = _delivered(session, scope)
        if not tally.covered:
            tally.notes.append("the gateway tap delivered no record of this target in the window")
        kind = scope.criterion.kind
        if kind == "at_risk":
            _count_minutes(session, scope, in_window, tally)
            tally.notes.append(
                "requests outside the kept rows are counted by the minute: first and last are minutes"
            )
        elif kind in ("over_pool", "flagged"):
            _count_rows(session, scope, tally)
        return tally

    def requests(self, session: Session, scope: Scope, limit: int) -> list[RequestRow]:
        """Return the kept rows that match, oldest first: one per response, however many share an id.

        The request id is the gateway's id of the response (``upstream_id``), which is what a
        customer holds (the response's ``id``) and what the gateway's logs and LiteLLM's spend log
        list, so every source names a request alike; where the gateway gave none, the record's own
        id. Two responses under one repeated upstream id are two lines, told apart by their times:
        the record's id would tell them apart too, but no customer could look it up. At-risk counts
        are by the minute and name no request: the list is empty."""
        if scope.criterion.kind not in ("over_pool", "flagged"):
            return []
        shown = func.coalesce(func.nullif(R.upstream_id, ""), R.request_id)
        query = (
            select(shown, R.caller, _own(scope), _epoch(R.started_at))
            .where(and_(*row_filter(scope)))
            .order_by(R.started_at, R.id)
            .limit(limit)
        )
        return [(rid, caller, bool(own), float(t)) for rid, caller, own, t in session.execute(query)]


def _delivered(session: Session, scope: Scope) -> tuple[float, float] | None:
    """What the tap delivered of this target at all (not only in the window): how much of it is seen."""
    first, last = session.execute(
        select(func.min(M.minute), func.max(M.minute)).where(M.target_id == scope.target_id)
    ).one()
    if first is None:
        return None
    return (first.timestamp(), last.timestamp() + 60)  # a minute row covers its whole minute


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


def _count_rows(session: Session, scope: Scope, tally: Tally) -> None:
    own = _own(scope).label("own")
    callers = (
        select(R.caller, own, func.count(), func.min(R.started_at), func.max(R.started_at))
        .where(*row_filter(scope))
        .group_by(R.caller, own)
    )
    # First and last come back as times (no per-row conversion), made epoch seconds here.
    tally.add_callers(
        (c, o, n, lo.timestamp(), hi.timestamp()) for c, o, n, lo, hi in session.execute(callers)
    )
    bucket = _bucket(scope, R.started_at).label("bucket")
    customers = [~_own(scope), R.caller.not_in(scope.exclude)] if scope.exclude else [~_own(scope)]
    buckets = select(bucket, func.count()).where(*row_filter(scope), *customers).group_by(bucket)
    tally.add_buckets(tuple(row) for row in session.execute(buckets))


def _count_minutes(session: Session, scope: Scope, in_window: list[Any], tally: Tally) -> None:
    first, last = func.min(_epoch(M.minute)), func.max(_epoch(M.minute))
    callers = (
        select(M.caller, func.sum(M.answered - M.own), func.sum(M.own), first, last)
        .where(*in_window)
        .group_by(M.caller)
    )
    rows: list[tuple[Any, ...]] = []
    for caller, theirs, own, lo, hi in session.execute(callers):
        rows += [(caller, False, theirs, lo, hi)] if theirs else []
        rows += [(caller, True, own, lo, hi)] if own else []
    tally.add_callers(rows)
    bucket = _bucket(scope, M.minute).label("bucket")
    customers = [M.caller.not_in(scope.exclude)] if scope.exclude else []
    buckets = select(bucket, func.sum(M.answered - M.own)).where(*in_window, *customers).group_by(bucket)
    tally.add_buckets((b, n) for b, n in session.execute(buckets) if n)
