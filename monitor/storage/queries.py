"""Read functions for the REST API and the metrics collector. Keyword-only, read-only.

Time filters take timezone-aware datetimes (a naive one is taken as UTC); ``since`` is inclusive
and ``until`` exclusive.

Lists are newest first, with ``id`` breaking ties, and page by keyset: a page ends with the
:class:`Key` of its last row, and the next page holds the rows strictly older than that key, so
rows recorded meanwhile (which are newer) neither repeat nor push rows onto the next page. Each
page reads one ordered range of an index that leads with equality filters and ends in (time, id)
(``PROBE_RESULT_SCANS``, ``INCIDENT_SCANS``; the indexes are declared in ``models.py``), so a page
costs the same on a table of ten rows or ten million. Filters that the chosen index does not lead
with are applied to the rows of that range, at most ``scan_limit`` of them per page: such a page
may hold fewer than ``limit`` rows, even none, and still have a ``next_key`` (see
:func:`_keyset_page`). Only ``next_key`` None means the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    Row,
    Select,
    String,
    bindparam,
    literal,
    select,
    tuple_,
    union_all,
)
from sqlalchemy.orm import InstrumentedAttribute, Session

from monitor.storage.db import as_utc
from monitor.storage.models import Incident, IncidentEvent, ProbeResultRow, Target, TrafficRecordRow

#: How many linked probe results an incident's detail carries by default.
DETAIL_RESULTS = 50

#: Rows of an index range one page reads at most when some filters are not in the index. A page
#: that reads them all and matches none ("node absent" in bench/rest_scale.py) takes about 5 ms at
#: 10 M rows; a bigger budget means fewer short pages but a longer tail.
SCAN_LIMIT = 2_000

#: The equality filters each probe_result index leads with, before (started_at, id); a page uses
#: the first whose filters were all given. Tried in this order: a verdict filter is usually after
#: the rare failures, so (target, verdict) beats (target, probe) when both fit.
PROBE_RESULT_SCANS: tuple[tuple[str, ...], ...] = (
    ("target", "verdict"),
    ("target", "probe"),
    ("target",),
    ("verdict",),
    (),
)
#: The same for incident, before (opened_at, id). Open incidents are few, so state comes first.
INCIDENT_SCANS: tuple[tuple[str, ...], ...] = (("target", "state"), ("state",), ("target",), ())


@dataclass(frozen=True)
class IncidentDetail:
    """One incident with its whole timeline (oldest first) and its most recent linked results.

    ``incident`` and ``results`` are rows as in :class:`Page`; ``events`` are ORM objects.
    """

    incident: Row[Any]
    events: list[IncidentEvent]
    results: list[Row[Any]]


@dataclass(frozen=True)
class Key:
    """Where a row sits in a newest-first list: its time (``started_at``/``opened_at``) and its id."""

    at: datetime
    id: int


@dataclass(frozen=True)
class Page:
    """One page of a list: rows of every column of the table plus ``target`` (the target's name).

    ``next_key`` None: no older row matches; else pass it as ``after`` for the next page.
    """

    rows: list[Row[Any]]
    next_key: Key | None


@dataclass(frozen=True)
class _Listing:
    """How one table is paged: its time column, its filterable columns and its indexed scans."""

    model: Any
    id: InstrumentedAttribute[int]
    target_id: InstrumentedAttribute[int]
    at: InstrumentedAttribute[datetime]
    columns: dict[str, InstrumentedAttribute[str]]
    scans: tuple[tuple[str, ...], ...]
    #: Filters on a list column (``,a,b,``): ``name`` holds ``value`` as one item.
    lists: dict[str, InstrumentedAttribute[str]] = field(default_factory=dict)

    def equal(self, name: str, value: str) -> ColumnElement[bool]:
        """Return ``name == value``; ``target`` is a name, looked up once by a scalar subquery."""
        if name in self.lists:
            return self.lists[name].contains(f",{value},", autoescape=True)
        if name == "target":
            # Joining target would hide the index order behind the join; a scalar subquery is a
            # constant to the planner, so `target_id = $1` stays an index bound.
            return self.target_id == select(Target.id).where(Target.name == value).scalar_subquery()
        return self.columns[name] == value

    def rows(self) -> Select[Any]:
        """Return a SELECT of every column plus ``target``, the target's name.

        Plain rows, not ORM objects: nothing here is written back, and the identity map would
        triple the cost of a 500-row page.
        """
        table = self.model.__table__
        return select(*table.c, Target.name.label("target")).join(Target, Target.id == self.target_id)

    def newest_first(self) -> tuple[ColumnElement[datetime], ColumnElement[int]]:
        return self.at.desc(), self.id.desc()

    def older_than(self, key: Key) -> ColumnElement[bool]:
        # A row-value comparison is one index bound on both databases, unlike its OR expansion.
        return tuple_(self.at, self.id) < self._bound(key)

    def not_older_than(self, key: Key) -> ColumnElement[bool]:
        return tuple_(self.at, self.id) >= self._bound(key)

    def key(self, row: Any) -> Key:
        return Key(getattr(row, self.at.key), row.id)

    def _bound(self, key: Key) -> ColumnElement[Any]:
        # Typed like the columns, so that SQLite compares its UTC text with UTC text.
        return tuple_(bindparam(None, as_utc(key.at), type_=self.at.type), literal(key.id, Integer))


_RESULTS = _Listing(
    ProbeResultRow,
    ProbeResultRow.id,
    ProbeResultRow.target_id,
    ProbeResultRow.started_at,
    {"probe": ProbeResultRow.probe, "node": ProbeResultRow.node, "verdict": ProbeResultRow.verdict},
    PROBE_RESULT_SCANS,
)
_INCIDENTS = _Listing(
    Incident,
    Incident.id,
    Incident.target_id,
    Incident.opened_at,
    {"probe": Incident.probe, "node": Incident.node, "severity": Incident.severity, "state": Incident.state},
    INCIDENT_SCANS,
)


_TRAFFIC = _Listing(
    TrafficRecordRow,
    TrafficRecordRow.id,
    TrafficRecordRow.target_id,
    TrafficRecordRow.started_at,
    {"caller": TrafficRecordRow.caller, "verdict": TrafficRecordRow.verdict, "node": TrafficRecordRow.node},
    (("target",), ("caller",), ("verdict",), ()),
    lists={"check": TrafficRecordRow.checks},
)


def list_traffic(
    session: Session,
    *,
    filters: dict[str, str | None],
    since: datetime | None = None,
    until: datetime | None = None,
    after: Key | None = None,
    limit: int = 50,
    offset: int = 0,
    scan_limit: int = SCAN_LIMIT,
) -> Page:
    """Return one page of kept traffic records, newest first by when the request started.

    ``filters``: ``target``, ``caller``, ``check``, ``verdict``, ``node`` (None: no filter)."""
    return _keyset_page(
        session, _TRAFFIC, filters, since=since, until=until, after=after, limit=limit, offset=offset,
        scan_limit=scan_limit,
    )  # fmt: skip


def list_incidents(
    session: Session,
    *,
    target: str | None = None,
    probe: str | None = None,
    node: str | None = None,
    severity: str | None = None,
    state: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after: Key | None = None,
    limit: int = 50,
    offset: int = 0,
    scan_limit: int = SCAN_LIMIT,
) -> Page:
    """Return one page of incidents, newest opened first.

    ``since``/``until`` bound ``opened_at``; ``after`` continues from a previous page's
    ``next_key``. A None filter does not filter. ``offset`` skips matching rows; see
    :func:`_keyset_page` for what it costs, and the module docstring for ``scan_limit``.
    """
    filters = {"target": target, "probe": probe, "node": node, "severity": severity, "state": state}
    return _keyset_page(
        session,
        _INCIDENTS,
        filters,
        since=since,
        until=until,
        after=after,
        limit=limit,
        offset=offset,
        scan_limit=scan_limit,
    )


def incident_opened_at(session: Session, incident_id: int) -> datetime | None:
    """Return when the incident opened (one primary-key read), or None when there is none."""
    return session.scalar(select(Incident.opened_at).where(Incident.id == incident_id))


def get_incident(
    session: Session, *, incident_id: int, results_limit: int = DETAIL_RESULTS
) -> IncidentDetail | None:
    """Return the incident with its events and its ``results_limit`` most recent linked results.

    Return None when no incident has that id.
    """
    incident = session.execute(_INCIDENTS.rows().where(Incident.id == incident_id)).one_or_none()
    if incident is None:
        return None
    events = session.scalars(
        select(IncidentEvent)
        .where(IncidentEvent.incident_id == incident_id)
        .order_by(IncidentEvent.created_at, IncidentEvent.id)
    )
    results = session.execute(
        _RESULTS.rows()
        .where(ProbeResultRow.incident_id == incident_id)
        .order_by(*_RESULTS.newest_first())
        .limit(results_limit)
    )
    return IncidentDetail(incident, list(events), list(results))


def list_probe_results(
    session: Session,
    *,
    target: str | None = None,
    probe: str | None = None,
    node: str | None = None,
    verdict: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after: Key | None = None,
    limit: int = 50,
    offset: int = 0,
    scan_limit: int = SCAN_LIMIT,
) -> Page:
    """Return one page of probe results, newest first.

    ``since``/``until`` bound ``started_at``; ``after`` continues from a previous page's
    ``next_key``. A None filter does not filter. ``offset`` skips matching rows; see
    :func:`_keyset_page` for what it costs, and the module docstring for ``scan_limit``.
    """
    filters = {"target": target, "probe": probe, "node": node, "verdict": verdict}
    return _keyset_page(
        session,
        _RESULTS,
        filters,
        since=since,
        until=until,
        after=after,
        limit=limit,
        offset=offset,
        scan_limit=scan_limit,
    )


def last_verdicts(
    session: Session, *, pairs: Iterable[tuple[str, str]]
) -> dict[str, dict[str, tuple[str, datetime, str]]]:
    """Return ``{target_name: {probe: (verdict, started_at, reason)}}`` of each pair's latest result.

    ``pairs`` are the (target name, probe) pairs asked about; one that never recorded a result is
    absent. Latest means the greatest ``started_at``, then the greatest ``id``. Each (target, probe
    kind) costs a few descents of ``ix_probe_result_target_probe_started_id``, however long the
    history (see :func:`_latest`).
    """
    wanted = set(pairs)
    latest = [_latest(probe) for probe in sorted({probe for _, probe in wanted})]
    if not latest:
        return {}
    out: dict[str, dict[str, tuple[str, datetime, str]]] = {}
    for name, probe, verdict, started_at, reason in session.execute(union_all(*latest)):
        if verdict is not None and (name, probe) in wanted:
            out.setdefault(name, {})[probe] = (verdict, started_at, reason)
    return out


def _keyset_page(
    session: Session,
    listing: _Listing,
    filters: dict[str, str | None],
    *,
    since: datetime | None,
    until: datetime | None,
    after: Key | None,
    limit: int,
    offset: int,
    scan_limit: int,
) -> Page:
    """Return the page of ``listing`` below ``after`` that matches ``filters`` and the time range.

    The page reads the first scan in ``listing.scans`` whose filters were all given: an index range
    in (time, id) order. Other filters ("rest") could match anything from every row of that range
    to none, so a page with such filters reads at most ``scan_limit`` rows of the range (up to the
    "floor" row): when they match fewer than ``limit`` of those, the page is short and its
    ``next_key`` is the floor, from which the next page goes on.

    Without other filters an ``offset`` becomes the key of the row it skips to, found in the index
    alone (no table reads for the skipped rows). With them it stays an OFFSET over matching rows,
    and no budget bounds it: the API documents offset as a compatibility path and cursors as the
    way to page.
    """
    ranged, rest = _conditions(listing, filters, since=since, until=until, after=after)
    if offset and not rest:
        start = _nth_key(session, listing, ranged, offset)
        if start is None:
            return Page([], None)
        ranged.append(listing.older_than(start))
        offset = 0
    floor = _nth_key(session, listing, ranged, scan_limit) if rest and not offset else None
    if floor is not None:
        ranged.append(listing.not_older_than(floor))
    query = (
        listing.rows()
        .where(*ranged, *rest)
        .order_by(*listing.newest_first())
        .offset(offset)
        .limit(limit + 1)  # one more than asked: whether a next page exists, without a count
    )
    rows = list(session.execute(query))
    if len(rows) > limit:
        return Page(rows[:limit], listing.key(rows[limit - 1]))
    return Page(rows, floor)


def _conditions(
    listing: _Listing,
    filters: dict[str, str | None],
    *,
    since: datetime | None,
    until: datetime | None,
    after: Key | None,
) -> tuple[list[ColumnElement[bool]], list[ColumnElement[bool]]]:
    """Return the conditions that bound the chosen index range, and the other filters."""
    given = {name: value for name, value in filters.items() if value is not None}
    scan = next(names for names in listing.scans if set(names) <= set(given))
    ranged = [listing.equal(name, given[name]) for name in scan]
    if since is not None:
        ranged.append(listing.at >= as_utc(since))
    if until is not None:
        ranged.append(listing.at < as_utc(until))
    if after is not None:
        ranged.append(listing.older_than(after))
    return ranged, [listing.equal(name, value) for name, value in given.items() if name not in scan]


def _nth_key(
    session: Session, listing: _Listing, ranged: Sequence[ColumnElement[bool]], n: int
) -> Key | None:
    """Return the key of the ``n``-th row (from 1) of the index range; None when it holds fewer.

    Every column it reads is in the index, so PostgreSQL reads the index alone. Bounding a page
    by a key rather than by a row count keeps it exact when newer rows arrive in between.
    """
    row = session.execute(
        select(listing.at, listing.id).where(*ranged).order_by(*listing.newest_first()).offset(n - 1).limit(1)
    ).first()
    return None if row is None else Key(row[0], row[1])


def _latest(probe: str) -> Select[Any]:
    """Return a SELECT of (target name, probe, verdict, started_at, reason) of the latest ``probe``
    result of every target row (verdict None: it has none).

    Each value is a correlated subquery: one descent of the (target, probe, started_at, id) index
    per target, so no plan scans probe_result, whatever its size. The three see one snapshot and
    one order, hence one row. Naming no target keeps the statement constant for the caches.
    """

    def newest(column: InstrumentedAttribute[Any]) -> Any:
        return (
            select(column)
            .where(ProbeResultRow.target_id == Target.id, ProbeResultRow.probe == probe)
            .order_by(*_RESULTS.newest_first())
            .limit(1)
            .correlate(Target)
            .scalar_subquery()
        )

    return select(
        Target.name,
        literal(probe, String),
        newest(ProbeResultRow.verdict),
        newest(ProbeResultRow.started_at),
        newest(ProbeResultRow.reason),
    )
