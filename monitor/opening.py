"""What the monitor opens before it is built: every secret it holds, the traffic stream, and the
database (checked and locked) with the spool that stands in for it while it is away.

``Monitor.open`` (``app.py``) calls these, so that whatever can be wrong at start is found there,
before anything listens, each error naming its key or its file; building the monitor from what
they return reads nothing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.secrets import (
    TenantKeys,
    alertmanager_headers,
    api_token,
    ingest_token,
    marker_key,
    tenant_keys,
)
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.containment.signing import SetSigner, signer_of
from kvcanary.monitor.recording.spool import Spool, open_spool
from kvcanary.monitor.storage.db import check_migrated, make_engine, make_session_factory
from kvcanary.monitor.storage.sqlite_file import SqliteFile, sqlite_file_of

log = logging.getLogger("kvcanary")


@dataclass(frozen=True)
class Secrets:
    """Every secret the monitor holds, read once at start (a reload reads the tenants' keys and the
    signing key again: ``reloads.py``)."""

    #: The bearer token of ``/api/v1``; None for a local-only API without auth.
    api_token: str | None
    tenant_keys: TenantKeys
    #: Each Alertmanager's headers, by its URL.
    alertmanager_headers: dict[str, dict[str, str]]
    marker_key: bytes | None
    ingest_token: str | None
    #: Signs the quarantine set (None: no key, and none needed).
    signer: SetSigner | None
    #: NATS's token, where traffic comes from the stream.
    nats_token: str | None
    #: The OpenTelemetry export's headers, where verdicts are sent as events.
    otlp_headers: dict[str, str]

    @classmethod
    def read(cls, settings: Settings) -> Secrets:
        """Read every secret ``settings`` name; raise ``ConfigError`` naming the key of one missing or
        unusable (never its value)."""
        token = api_token(settings)
        keys = tenant_keys(settings)
        headers = alertmanager_headers(settings)
        nats = otlp = None
        if settings.traffic.source == "jetstream":
            from kvcanary.monitor.traffic.stream_setup import nats_token  # nats-py only when used

            nats = nats_token(settings.traffic.jetstream)
        if settings.otel is not None:
            from kvcanary.monitor.otel import otlp_headers  # the OpenTelemetry SDK only when used

            otlp = otlp_headers(settings.otel)
        return cls(
            api_token=token, tenant_keys=keys, alertmanager_headers=headers,
            marker_key=marker_key(settings, token), ingest_token=ingest_token(settings),
            signer=signer_of(settings), nats_token=nats, otlp_headers=otlp or {},
        )  # fmt: skip


def check_stream(settings: Settings, token: str | None) -> None:
    """Reach NATS and create or update the traffic stream; raise ConfigError naming the URL
    (``kvcanary serve`` exits 2 with that one line) when it cannot."""
    from kvcanary.monitor.traffic.stream_setup import verify  # nats-py only when used

    jetstream = settings.traffic.jetstream
    asyncio.run(verify(jetstream, token))
    log.info(
        "traffic stream %s ready at %s (%d partitions)", jetstream.stream, jetstream.url, jetstream.partitions
    )


@dataclass(frozen=True)
class Database:
    """The database as the monitor holds it, and the spool in front of it."""

    engine: Engine
    #: Sessions that write (the recorder's, the pager's, containment's).
    session_factory: sessionmaker[Session]
    #: Sessions that only read (the API's, the exported gauges').
    read_session_factory: sessionmaker[Session]
    #: The SQLite file, locked to this process; None on PostgreSQL.
    sqlite: SqliteFile | None
    spool: Spool

    @classmethod
    def open(cls, settings: Settings) -> Database:
        """Open the database and the spool. Raise ``DatabaseNotMigrated`` for an old schema and
        ``DatabaseInUse`` for a SQLite file another process holds."""
        engine = make_engine(settings.database_url)
        check_migrated(engine)
        sqlite = sqlite_file_of(settings.database_url)
        if sqlite is not None:
            sqlite.lock()  # SQLite is one process
            sqlite.guard(engine)
        return cls(
            engine=engine, session_factory=make_session_factory(engine),
            read_session_factory=make_session_factory(engine, read_only=True), sqlite=sqlite,
            spool=open_spool(settings),
        )  # fmt: skip

    @property
    def shared(self) -> bool:
        """Whether other replicas may share the database (PostgreSQL); SQLite is one process."""
        return self.engine.dialect.name == "postgresql"

    def close(self) -> None:
        self.spool.close()
        self.engine.dispose()
        if self.sqlite is not None:
            self.sqlite.close()
