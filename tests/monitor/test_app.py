"""The composition root: the monitor is built from what was opened without touching the world, and
touches it only when started."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import event, select

from kvcanary.monitor.app import Monitor
from kvcanary.monitor.config.secrets import TenantKeys
from kvcanary.monitor.config.settings import parse_settings
from kvcanary.monitor.opening import Database, Secrets
from kvcanary.monitor.recording.spool import Spool
from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.monitor.storage.models import Target


def test_the_monitor_is_built_without_a_connection_and_connects_only_when_started(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    upgrade(url)
    # Each tenant names a variable no one set: reading the secrets here would raise.
    tenants = [{"name": n, "api_key_env": f"KVCANARY_TEST_UNSET_{n.upper()}"} for n in ("a", "b")]
    target = {"name": "t", "base_url": "http://127.0.0.1:9", "engine": "reference", "tenants": tenants}
    settings = parse_settings({"database_url": url, "api": {"local_only": True}, "targets": [target]})
    engine = make_engine(url)
    connections: list[object] = []
    event.listen(engine, "connect", lambda *_: connections.append(1))
    database = Database(
        engine=engine, session_factory=make_session_factory(engine),
        read_session_factory=make_session_factory(engine, read_only=True), sqlite=None, spool=Spool(None),
    )  # fmt: skip
    secrets = Secrets(
        api_token=None, tenant_keys=TenantKeys({("t", "a"): "key-a", ("t", "b"): "key-b"}),
        alertmanager_headers={}, marker_key=None, ingest_token=None, signer=None, nats_token=None,
        otlp_headers={},
    )  # fmt: skip

    monitor = Monitor(settings, secrets, database)
    assert not connections

    async def start_and_stop() -> None:
        monitor.start()
        await monitor.stop(drain_seconds=0)

    asyncio.run(start_and_stop())
    assert connections  # started: the target's row was made, the stored states read
    with make_session_factory(make_engine(url))() as session:
        assert session.scalars(select(Target.name)).all() == ["t"]
