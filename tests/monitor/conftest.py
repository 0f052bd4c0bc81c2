"""Database and API fixtures for the monitor's tests, on real SQLite and real PostgreSQL.

``db_url`` is parametrised over a SQLite file and the session's PostgreSQL database (marked
``external_service``); each is migrated once with :func:`monitor.storage.db.upgrade`. Tests are
isolated by emptying the tables before (and after) each test rather than by rolling back, because
the race tests need two connections that really commit. ``scratch_url`` is an empty database for
the migration tests: a new SQLite file, or a second PostgreSQL database whose schema is wiped.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, delete, make_url, text
from sqlalchemy.orm import Session, sessionmaker

from monitor.api.main import build_http_app
from monitor.api.state import ApiState
from monitor.config.settings import IncidentConfig, RetentionConfig, Settings
from monitor.incidents import RecordOutcome, record_result
from monitor.metrics.registry import MonitorMetrics
from monitor.runs.run_now import RunNow
from monitor.storage.db import make_engine, make_session_factory, upgrade
from monitor.storage.models import (
    Incident,
    IncidentEvent,
    ProbeResultRow,
    Target,
    TrafficMinute,
    TrafficRecordRow,
)
from probes.base import ProbeResult, Verdict
from tests.monitor.served import served  # noqa: F401 (a fixture: `kvcanary serve` as a process)
from tests.services import Alertmanager, start_alertmanager

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
POLICY = IncidentConfig(resolve_after_passes=3, error_warning_after_seconds=300)
RETENTION = RetentionConfig(pass_days=7, failure_days=90)

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgresql", id="postgresql", marks=pytest.mark.external_service),
]


# --- databases ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session", params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A database migrated to head: a SQLite file, or the session's PostgreSQL database."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'kvcanary.db'}"
    else:
        url = str(request.getfixturevalue("postgres_url"))
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def db_engine(db_url: str) -> Iterator[Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def empty_tables(engine: Engine) -> None:
    """Delete every row, children first. A transaction a test left open fails this, not hangs it."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SET LOCAL lock_timeout = '30s'"))
        for model in (TrafficRecordRow, TrafficMinute, IncidentEvent, ProbeResultRow, Incident, Target):
            conn.execute(delete(model))


@pytest.fixture
def session_factory(db_engine: Engine) -> Iterator[sessionmaker[Session]]:
    """A session factory on empty tables; whatever a test commits is deleted afterwards."""
    empty_tables(db_engine)
    yield make_session_factory(db_engine)
    empty_tables(db_engine)


@pytest.fixture
def session(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as s:
        yield s


@pytest.fixture(scope="session")
def _scratch_postgres(postgres_url: str) -> Iterator[str]:
    """A second PostgreSQL database next to the session's one, for tests that need it empty."""
    url = make_url(postgres_url)
    name = f"{url.database}_scratch_{uuid.uuid4().hex[:6]}"
    admin = f"host={url.host} port={url.port or 5432} user={url.username} dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=BACKENDS)
def scratch_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a new SQLite file, or the scratch PostgreSQL database with its schema wiped."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'scratch.db'}"
    url = str(request.getfixturevalue("_scratch_postgres"))
    plain = make_url(url)
    dsn = f"host={plain.host} port={plain.port or 5432} user={plain.username} dbname={plain.database}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    return url


# --- recording ---------------------------------------------------------------------------------------


def outcome(verdict: str, reason: str = "", detail: str = "", **measurements: float) -> ProbeResult:
    """A probe's result with ``verdict``; ``reason`` defaults to a plausible token per verdict."""
    default = {"pass": "ok", "leak": "foreign_marker", "mismatch": "wrong_answer", "error": "timeout"}
    return ProbeResult(
        Verdict(verdict),
        reason or default[verdict],
        detail or f"{verdict} seen",
        evidence={"marker_ids": ["m-1"]} if verdict == "leak" else {},
        measurements=dict(measurements),
    )


def record(
    factory: sessionmaker[Session],
    verdict: str,
    *,
    at: datetime,
    target: str = "glm-prod",
    probe: str = "cross_tenant",
    policy: IncidentConfig = POLICY,
    reason: str = "",
    detail: str = "",
    **measurements: float,
) -> RecordOutcome:
    """Record one result in its own committed transaction, the way the runner does."""
    with factory() as s, s.begin():
        return record_result(
            s,
            target_name=target,
            engine="sglang",
            base_url="http://127.0.0.1:30000/v1",
            model="glm-5.3",
            probe=probe,
            result=outcome(verdict, reason, detail, **measurements),
            started_at=at,
            duration_seconds=0.5,
            policy=policy,
            retention=RETENTION,
            now=at + timedelta(seconds=1),
        )


def minutes(n: float) -> datetime:
    return T0 + timedelta(minutes=n)


# --- the API -----------------------------------------------------------------------------------------

RunTarget = Callable[[str], Awaitable[list[dict[str, Any]]]]


def build_app(
    factory: sessionmaker[Session],
    *,
    settings: Settings,
    token: str | None,
    run_target: RunTarget | None = None,
    health: Callable[[], dict[str, Any]] | None = None,
) -> FastAPI:
    """Return the service's own app (``build_http_app``) over ``factory`` and ``settings``."""

    async def no_run(name: str) -> list[dict[str, Any]]:
        raise KeyError(name)

    state = ApiState(
        session_factory=factory,
        api_token=token,
        settings=settings,
        run_now=RunNow(run_target or no_run, min_interval=0),
        health=health or (lambda: {"scheduler": "running"}),
        metrics_page=MonitorMetrics(CollectorRegistry()).exposition,
    )
    return build_http_app(state, title="kvcanary (test)")


def settings_with_targets() -> Settings:
    """Two configured targets; the first has credentials in its URL that must never be served."""
    tenants = [{"name": "alice"}, {"name": "bob"}]
    return Settings.model_validate(
        {
            "targets": [
                {
                    "name": "glm-prod",
                    "base_url": "http://127.0.0.1:30000/v1",
                    "engine": "sglang",
                    "model": "glm-5.3",
                    "tenants": tenants,
                    "probes": ["canary", "cross_tenant"],
                },
                {
                    "name": "llama-dev",
                    "base_url": "http://127.0.0.1:8080",
                    "engine": "llamacpp",
                    "tenants": tenants,
                },
            ]
        }
    )


# --- paging --------------------------------------------------------------------------------------------


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    """A real Alertmanager (the Debian package) on a free loopback port."""
    am = start_alertmanager(tmp_path / "am")
    yield am
    am.stop()
