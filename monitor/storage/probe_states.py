"""Store and read what a probe carries from one run to the next (``probe_state``)."""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from kvcanary.monitor.storage.models import ProbeState, Target
from kvcanary.monitor.storage.storable import jsonable


def save_state(
    session: Session, *, target_id: int, probe: str, node: str, state: dict[str, Any], now: datetime
) -> None:
    """Store what a probe carries to its next run on (target, node), replacing what was there."""
    values = dict(target_id=target_id, probe=probe, node=node, state=jsonable(state), updated_at=now)
    session.execute(_state_upsert(session.get_bind().dialect.name), values)


@functools.cache
def _state_upsert(dialect_name: str) -> Any:
    """The upsert of a probe_state row, built once: ``excluded`` builds a column set each time."""
    dialect = postgresql if dialect_name == "postgresql" else sqlite
    stmt = dialect.insert(ProbeState)
    return stmt.on_conflict_do_update(
        index_elements=["target_id", "probe", "node"],
        set_={"state": stmt.excluded.state, "updated_at": stmt.excluded.updated_at},
    )


def load_state(session: Session, *, target: str, probe: str, node: str) -> dict[str, Any] | None:
    """Return the state a probe stored for (target, node), or None when it never stored one."""
    query = (
        select(ProbeState.state)
        .join(Target, Target.id == ProbeState.target_id)
        .where(Target.name == target, ProbeState.probe == probe, ProbeState.node == node)
    )
    state = session.execute(query).scalar_one_or_none()
    return dict(state) if isinstance(state, dict) else None


def load_states(session: Session) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Return every stored probe state by (target, probe, node): one read at start, not one per pair."""
    query = select(Target.name, ProbeState.probe, ProbeState.node, ProbeState.state).join(
        Target, Target.id == ProbeState.target_id
    )
    return {(t, p, n): dict(state) for t, p, n, state in session.execute(query) if isinstance(state, dict)}
