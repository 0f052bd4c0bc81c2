"""Upsert the ``target`` rows results belong to: read first, written only on a change."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from kvcanary.monitor.storage.models import Target, public_url


def upsert_target(
    session: Session, *, name: str, engine: str, base_url: str, model: str, now: datetime
) -> int:
    """Return the id of target ``name``, inserting it or updating what changed.

    ``base_url`` is stored as :func:`public_url` (no credentials). The row is read first and
    written only on a change: an unchanged target takes no row lock, so replicas recording results
    for it do not queue behind each other. Concurrent first inserts are settled by the unique name.
    """
    base_url = public_url(base_url)
    query = select(Target.id, Target.engine, Target.base_url, Target.model).where(Target.name == name)
    row = session.execute(query).one_or_none()
    if row is None:
        dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
        values = dict(
            name=name, engine=engine, base_url=base_url, model=model, created_at=now, updated_at=now
        )
        session.execute(
            dialect.insert(Target).values(**values).on_conflict_do_nothing(index_elements=["name"])
        )
        row = session.execute(query).one()
    if (row.engine, row.base_url, row.model) != (engine, base_url, model):
        session.execute(
            update(Target)
            .where(Target.id == row.id)
            .values(engine=engine, base_url=base_url, model=model, updated_at=now)
        )
    return int(row.id)


def upsert_targets(
    session: Session, targets: Iterable[tuple[str, str, str, str]], now: datetime
) -> dict[str, int]:
    """Return the ids of ``(name, engine, base_url, model)`` targets by name, after one read of the
    table; only targets that are new or changed are written (:func:`upsert_target`)."""
    query = select(Target.name, Target.id, Target.engine, Target.base_url, Target.model)
    rows = {row.name: row for row in session.execute(query)}
    ids = {}
    for name, engine, base_url, model in targets:
        row = rows.get(name)
        if row is not None and (row.engine, row.base_url, row.model) == (engine, public_url(base_url), model):
            ids[name] = int(row.id)
        else:
            ids[name] = upsert_target(
                session, name=name, engine=engine, base_url=base_url, model=model, now=now
            )
    return ids
