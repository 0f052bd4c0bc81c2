"""Database and Alertmanager fixtures for the monitor's tests, on real SQLite and real PostgreSQL.

``db_url`` is parametrised over a SQLite file and the session's PostgreSQL database (marked
``external_service``); each is migrated once with :func:`monitor.storage.db.upgrade`. Tests are
isolated by emptying the tables before (and after) each test rather than by rolling back, because
the race tests need two connections that really commit. ``scratch_url`` is an empty database for
the migration tests: a new SQLite file, or a second PostgreSQL database whose schema is wiped.
What the tests record and the app they build are ``tests.support.monitor_db`` and ``monitor_app``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from tests.monitor.served import served  # noqa: F401 (a fixture: `kvcanary serve` as a process)
from tests.support.monitor_db import empty_tables
from tests.support.services import Alertmanager, start_alertmanager

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


# --- paging --------------------------------------------------------------------------------------------


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    """A real Alertmanager (the Debian package) on a free loopback port."""
    am = start_alertmanager(tmp_path / "am")
    yield am
    am.stop()
