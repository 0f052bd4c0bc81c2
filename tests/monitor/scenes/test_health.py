"""`/healthz` and `kvcanary_database_up` say whether results are being written, not whether a read
works: `kvcanary serve` on a PostgreSQL of its own that keeps answering reads while it refuses
every write (as a primary demoted to read-only in a failover does, or a full disk)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest

from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import FakeEngine
from tests.support.loopback import Loopback
from tests.support.services import OwnPostgres

pytestmark = [pytest.mark.external_service, pytest.mark.slow]


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    server = OwnPostgres.create()
    yield server
    server.destroy()


def read_only(server: OwnPostgres, on: bool) -> None:
    """Make every transaction read-only (reads answer, writes fail with SQLSTATE 25006), or undo it."""
    with psycopg.connect(
        f"host=127.0.0.1 port={server.port} user=postgres dbname=postgres", autocommit=True
    ) as c:
        c.execute(f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'off'}")
        c.execute("SELECT pg_reload_conf()")


def health(monitor: Served) -> tuple[int, dict[str, Any]]:
    answer = httpx.get(monitor.url + "/healthz", timeout=10)
    return answer.status_code, answer.json()


def test_health_goes_red_while_reads_work_and_writes_fail(
    served: Callable[[dict[str, Any]], Served], own_postgres: OwnPostgres
) -> None:
    server = Loopback(FakeEngine())
    target = reference_target("ok", server.url, probes=["canary"], interval_seconds=0.5)
    monitor = served({"database_url": own_postgres.url, "targets": [target]})
    try:
        monitor.start()
        monitor.wait_for(
            "a first result written",
            lambda: monitor.value("kvcanary_database_last_write_success_timestamp_seconds"),
        )
        assert health(monitor)[0] == 200 and monitor.value("kvcanary_database_up") == 1

        read_only(own_postgres, True)
        monitor.wait_for(
            "results to wait in the spool", lambda: (monitor.value("kvcanary_spool_results") or 0) >= 3
        )
        status, body = health(monitor)
        assert status == 503 and body["database"] == "unwritable", body
        assert body["writes"]["status"] == "failing" and body["writes"]["last_error"] == "InternalError"
        assert monitor.value("kvcanary_database_up") == 0
        assert monitor.value("kvcanary_spool_max_results") == 10_000

        read_only(own_postgres, False)
        monitor.wait_for(
            "the spool to drain", lambda: monitor.value("kvcanary_spool_results") == 0, timeout=30
        )
        monitor.wait_for("health to come back", lambda: health(monitor)[0] == 200)
        assert monitor.value("kvcanary_database_up") == 1
    finally:
        monitor.stop()
        server.close()
