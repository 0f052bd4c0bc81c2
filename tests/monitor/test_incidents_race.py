"""Two monitor replicas recording at once, on two real PostgreSQL connections.

SQLite has one writer at a time, so these races only exist on PostgreSQL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor import incidents
from kvcanary.monitor.incidents import RecordOutcome, record_result
from kvcanary.monitor.storage.models import Incident, IncidentEvent
from tests.support.monitor_db import POLICY, RETENTION, T0, minutes, outcome, record

Factory = sessionmaker[Session]


@pytest.fixture
def pg_factory(db_url: str, session_factory: Factory) -> Factory:
    if not db_url.startswith("postgresql"):
        pytest.skip("a race between writers needs PostgreSQL (SQLite has one writer at a time)")
    return session_factory


def record_in(session: Session, verdict: str, at: Any) -> RecordOutcome:
    return record_result(
        session,
        target_name="glm-prod",
        engine="sglang",
        base_url="http://127.0.0.1:30000/v1",
        model="glm-5.3",
        probe="cross_tenant",
        result=outcome(verdict),
        started_at=at,
        duration_seconds=0.5,
        policy=POLICY,
        retention=RETENTION,
        now=at,
    )


def replica(factory: Factory) -> Session:
    """A session of its own connection that gives up waiting on a lock after 20 s instead of hanging."""
    session = factory()
    session.execute(text("SET lock_timeout = '20s'"))
    return session


def wait_until_blocked(engine: Engine, worker: threading.Thread, timeout: float = 60.0) -> None:
    """Return once some backend of this database waits on a lock, or once ``worker`` has finished."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while time.monotonic() < deadline and worker.is_alive():
            if conn.execute(query).scalar_one():
                return
            time.sleep(0.02)


def in_thread(work: Callable[[], RecordOutcome]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["outcome"] = work()
        except BaseException as exc:  # surfaced by the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def finish(thread: threading.Thread, *sessions: Session) -> None:
    """Join the racing thread before closing: a session must never be closed while another thread uses it."""
    thread.join(60)
    assert not thread.is_alive(), "the racing replica never finished"
    for session in sessions:
        session.close()


def test_two_replicas_opening_the_same_incident_yield_exactly_one(
    pg_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    inserts: list[int | None] = []
    real_try_open = incidents.try_open

    def spy(*args: Any, **kwargs: Any) -> int | None:
        inserts.append(real_try_open(*args, **kwargs))
        return inserts[-1]

    monkeypatch.setattr(incidents, "try_open", spy)
    record(pg_factory, "pass", at=T0)  # the target row exists and is unchanged: nobody waits on it
    first, second = replica(pg_factory), replica(pg_factory)
    won = record_in(first, "leak", minutes(1))  # inserted the open incident, not committed yet

    def race() -> RecordOutcome:
        out = record_in(second, "leak", minutes(1))  # blocks on the partial unique index
        second.commit()
        return out

    thread, box = in_thread(race)
    try:
        wait_until_blocked(first.get_bind(), thread)  # type: ignore[arg-type]
        first.commit()
    finally:
        finish(thread, first, second)

    assert "error" not in box, repr(box.get("error"))
    lost: RecordOutcome = box["outcome"]
    assert (won.change, lost.change) == ("opened", "attached")
    assert lost.incident_id == won.incident_id
    with pg_factory() as s:
        [incident] = s.scalars(select(Incident)).all()
        kinds = s.scalars(select(IncidentEvent.kind)).all()
    assert (incident.state, incident.failure_count) == ("open", 2)
    assert kinds == ["opened"]
    assert inserts == [won.incident_id, None], "the loser's INSERT hit the partial unique index"


def test_two_replicas_counting_the_last_pass_resolve_once(pg_factory: Factory) -> None:
    opened = record(pg_factory, "leak", at=T0)
    record(pg_factory, "pass", at=minutes(1))
    record(pg_factory, "pass", at=minutes(2))
    first, second = replica(pg_factory), replica(pg_factory)
    won = record_in(first, "pass", minutes(3))  # the third pass resolves it, uncommitted

    def race() -> RecordOutcome:
        out = record_in(second, "pass", minutes(3))  # waits on the incident's row lock
        second.commit()
        return out

    thread, box = in_thread(race)
    try:
        wait_until_blocked(first.get_bind(), thread)  # type: ignore[arg-type]
        first.commit()
    finally:
        finish(thread, first, second)

    assert "error" not in box, repr(box.get("error"))
    assert won.change == "resolved"
    assert box["outcome"].change is None, "the loser sees the incident resolved and changes nothing"
    with pg_factory() as s:
        kinds = s.scalars(
            select(IncidentEvent.kind).where(IncidentEvent.incident_id == opened.incident_id)
        ).all()
    assert kinds.count("resolved") == 1
