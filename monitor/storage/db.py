"""Engines, sessions, the declarative ``Base``, and Alembic run from code.

Both SQLite (one process, a file) and PostgreSQL (several monitor replicas) are supported; the
schema is the same and is only ever created by the migrations in ``migrations/``
(:func:`upgrade`). The service refuses to start on a database that is not at the head revision
(:func:`check_migrated`).

Timestamps are stored as UTC and always come back timezone-aware (:class:`UTCDateTime`); a naive
datetime handed in is taken to be UTC.
"""

from __future__ import annotations

import contextlib
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import DateTime, Engine, MetaData, create_engine, event, make_url
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

from kvcanary import monitor

#: The repository's migrations folder. It sits beside the ``monitor`` package, not inside it.
MIGRATIONS_DIR = Path(monitor.__file__).resolve().parent.parent / "migrations"

# Every constraint and index gets a deterministic name, so that migrations can drop or alter it
# by name on every backend (SQLite's unnamed constraints cannot be dropped later) and
# `alembic revision --autogenerate` produces the same names as the hand-written migrations.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """The declarative base of every kvcanary table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    PostgreSQL stores ``timestamptz``; SQLite stores text without an offset, so values are converted
    to UTC before they are written (which keeps text comparison equal to time comparison) and get
    ``tzinfo=UTC`` back when read. A naive datetime is taken to be UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return as_utc(value)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return as_utc(value)


def as_utc(value: datetime) -> datetime:
    """Return ``value`` in UTC; a naive datetime is taken to be UTC already."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def utcnow() -> datetime:
    """Return the current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


READ_ONLY_OPTION = "kvcanary_read_only"


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Return an Engine for ``url`` (``sqlite:///PATH`` or ``postgresql+psycopg://...``).

    SQLite: usable from several threads, WAL journal, foreign keys enforced, and every transaction
    begins IMMEDIATE. SQLite allows one writer; a deferred transaction that reads and then writes
    fails at once with "database is locked" when another connection wrote in between, whereas an
    IMMEDIATE one waits (up to the busy timeout) for its turn. This also makes SAVEPOINTs work,
    which pysqlite's own transaction handling breaks.

    PostgreSQL: connections are checked before use (``pool_pre_ping``), so a restarted server
    costs one reconnect instead of one failed probe recording.
    """
    # Parameters can hold probe evidence; keep them out of error messages and logs.
    kwargs.setdefault("hide_parameters", True)
    if url.startswith("sqlite"):
        _create_private(url)
        connect_args = {"check_same_thread": False, "timeout": 15.0, **kwargs.pop("connect_args", {})}
        engine = create_engine(url, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    # A server that is down refuses at once; one behind a dead network would hang a recording for
    # minutes without a connect timeout, and the verdict would wait instead of going to the spool.
    connect_args = {"connect_timeout": 5, **kwargs.pop("connect_args", {})}
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args, **kwargs)


def _create_private(url: str) -> None:
    """Create a new SQLite file readable by its owner only (0600): it holds failure evidence."""
    path = make_url(url).database
    if not path or path == ":memory:" or path.startswith("file:") or os.path.exists(path):
        return
    with contextlib.suppress(OSError):  # a missing folder: SQLite says so itself, naming the path
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def _sqlite_on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    # Take transaction control away from pysqlite; _sqlite_on_begin emits BEGIN itself.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _sqlite_on_begin(connection: Any) -> None:
    # Readers (the API, the /metrics gauge) begin DEFERRED: under WAL they never wait for, or block,
    # the probe recordings, which take the write lock up front.
    deferred = connection.get_execution_options().get(READ_ONLY_OPTION, False)
    connection.exec_driver_sql("BEGIN" if deferred else "BEGIN IMMEDIATE")


def make_session_factory(engine: Engine, *, read_only: bool = False) -> sessionmaker[Session]:
    """Return a Session factory bound to ``engine``; ``read_only`` sessions must not write.

    Objects stay readable after commit (``expire_on_commit=False``): API handlers serialise rows
    after the session is done with them. On SQLite, read-only sessions begin DEFERRED so that a
    scrape or an API page never queues behind (or blocks) a recording.
    """
    bind = engine.execution_options(**{READ_ONLY_OPTION: True}) if read_only else engine
    return sessionmaker(bind=bind, expire_on_commit=False)


# --- migrations --------------------------------------------------------------------------------------


class DatabaseNotMigrated(Exception):
    """The database schema is not at the migrations' head revision; ``str()`` says what to run."""


def alembic_config(url: str) -> Config:
    """Return an Alembic Config for ``url`` and the repository's migrations, from any cwd."""
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(
            f"the migrations folder {MIGRATIONS_DIR} is missing (is the repository intact?)"
        )
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation: a '%' in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: the head)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` (``"base"`` drops every table)."""
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    """Return the migrations' single head revision."""
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    head = script.get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def check_migrated(engine: Engine, *, config_path: str | None = None) -> None:
    """Return when the database behind ``engine`` is at the head revision.

    Raise DatabaseNotMigrated, whose message names the database (password hidden) and the
    command to run, when it is empty, behind, or at a revision this code does not know.
    """
    head = head_revision()
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_heads()
    if current == (head,):
        return
    where = engine.url.render_as_string(hide_password=True)
    run = f"run `kvcanary db upgrade --config {config_path or 'FILE'}`"
    if not current:
        raise DatabaseNotMigrated(f"database at {where} is not migrated: {run}")
    known = ScriptDirectory.from_config(alembic_config("sqlite://"))
    if any(_unknown_revision(known, rev) for rev in current):
        raise DatabaseNotMigrated(
            f"database at {where} is at revision {', '.join(current)}, which this kvcanary does not know "
            f"(head {head}): it was migrated by a newer version"
        )
    raise DatabaseNotMigrated(
        f"database at {where} is not migrated (at revision {', '.join(current)}, head {head}): {run}"
    )


def _unknown_revision(script: ScriptDirectory, rev: str) -> bool:
    try:
        return script.get_revision(rev) is None
    except Exception:  # alembic raises several kinds for an unknown id
        return True
