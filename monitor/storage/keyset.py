"""Keyset pages over an index: the machinery every newest-first list shares (``queries.py`` for
incidents and probe results, ``traffic_rows.py`` for kept traffic).

A :class:`Listing` says how one table is paged: its time column, its filterable columns and the
indexed scans it prefers. :func:`keyset_page` reads one page as one ordered index range (see
``queries.py``'s module doc for the guarantees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Integer, Row, Select, bindparam, literal, select, tuple_
from sqlalchemy.orm import InstrumentedAttribute, Session

from kvcanary.monitor.storage.db import as_utc
from kvcanary.monitor.storage.models import Target

#: Rows of an index range one page reads at most when some filters are not in the index. A page
#: that reads them all and matches none ("node absent" in bench/rest_scale.py) takes about 5 ms at
#: 10 M rows; a bigger budget means fewer short pages but a longer tail.
SCAN_LIMIT = 2_000


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
class Listing:
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


def keyset_page(
    session: Session,
    listing: Listing,
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
    listing: Listing,
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


def _nth_key(session: Session, listing: Listing, ranged: Sequence[ColumnElement[bool]], n: int) -> Key | None:
    """Return the key of the ``n``-th row (from 1) of the index range; None when it holds fewer.

    Every column it reads is in the index, so PostgreSQL reads the index alone. Bounding a page
    by a key rather than by a row count keeps it exact when newer rows arrive in between.
    """
    row = session.execute(
        select(listing.at, listing.id).where(*ranged).order_by(*listing.newest_first()).offset(n - 1).limit(1)
    ).first()
    return None if row is None else Key(row[0], row[1])
