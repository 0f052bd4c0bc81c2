"""The SQLite file under `kvcanary serve`: a second process refuses it, and a file deleted under the
running monitor is noticed within seconds, what it held is saved, and nothing after it is lost.

On main: two processes on one file ran every probe twice with no warning; a deleted file gave 40 s
and more of healthy answers from a deleted inode, and ~1,418 results and an open incident vanished.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvcanary.monitor.recording.health import WriteHealth
from kvcanary.monitor.storage.sqlite_file import SqliteFile
from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import REFERENCE_INFO, FakeEngine
from tests.support.loopback import Loopback

#: A node whose pool is below its window: the capacity audit opens an incident at once.
SMALL_POOL = {**REFERENCE_INFO, "kv_pools": {"prefill": 512, "decode": 4096}}


def rows(path: Path, table: str) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def config(url: str) -> dict[str, Any]:
    probes = {"canary": 0.5, "capacity": 0.5}
    target = reference_target("t", url, probes=list(probes), probe_intervals=probes)
    return {"targets": [target]}


def test_a_second_process_on_one_sqlite_file_refuses_to_start(
    served: Callable[..., Served], tmp_path: Path
) -> None:
    server = Loopback(FakeEngine())
    try:
        first = served(config(server.url), tmp_path / "a").start()
        second = served({**config(server.url), "database_url": first.config["database_url"]}, tmp_path / "b")
        second.write_config()
        done = second.kvcanary("serve", "--config", str(second.config_path))
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert f"in use by another kvcanary process (pid {first.proc.pid})" in done.stderr  # type: ignore[union-attr]
        assert "PostgreSQL" in done.stderr
    finally:
        server.close()


def test_a_sqlite_file_deleted_under_serve_is_noticed_saved_and_nothing_is_lost(
    served: Callable[..., Served],
) -> None:
    server = Loopback(FakeEngine(info=SMALL_POOL))
    monitor = served(config(server.url))
    db = Path(monitor.config["database_url"].removeprefix("sqlite:///"))
    try:
        monitor.start()
        monitor.wait_for("the capacity incident", lambda: monitor.get("/api/v1/incidents").json()["items"])
        monitor.wait_for("a few results", lambda: rows(db, "probe_result") >= 6)
        db.unlink()
        lost = monitor.wait_for(
            "the deletion to be noticed",
            lambda: (r := httpx.get(monitor.url + "/healthz", timeout=10)).status_code == 503 and r.json(),
            timeout=10,
        )
        # Unreachable once the pool is let go (no connection is opened to a path that is not the file).
        assert (
            lost["database"] in ("unwritable", "unreachable")
            and "was deleted" in lost["writes"]["last_error"]
        )
        assert monitor.value("kvcanary_database_up") == 0
        # Reported by the first health check after the deletion; saved by the watcher's next look.
        monitor.wait_for(
            "the copy to be saved", lambda: "what it held is saved as" in monitor.log(), timeout=10
        )
        saved = sorted(db.parent.glob(db.name + ".orphaned-*"))
        assert len(saved) == 1 and saved[0].stat().st_mode & 0o777 == 0o600
        assert rows(saved[0], "incident") == 1 and rows(saved[0], "probe_result") >= 6
        assert "was deleted" in monitor.log() and "CRITICAL" in monitor.log()
        monitor.wait_for(
            "results to wait in the spool", lambda: (monitor.value("kvcanary_spool_results") or 0) >= 4
        )
        assert not db.exists()  # no empty file was made in its place for results to vanish into
        spooled = monitor.value("kvcanary_spool_results") or 0
        before = rows(saved[0], "probe_result")
        monitor.stop()

        saved[0].rename(db)  # the operator puts the saved copy back, and restarts
        monitor.start(migrate=False)
        monitor.wait_for(
            "the spool to replay", lambda: monitor.value("kvcanary_spool_results") == 0, timeout=30
        )
        assert rows(db, "probe_result") >= before + spooled
        assert rows(db, "incident") == 1
        assert httpx.get(monitor.url + "/healthz", timeout=10).status_code == 200
    finally:
        monitor.stop()
        server.close()


def test_a_deleted_file_fails_the_write_health_at_once_before_the_watcher_saves_it(tmp_path: Path) -> None:
    path = tmp_path / "kvcanary.db"
    sqlite3.connect(path).close()
    file = SqliteFile(path)
    health = WriteHealth(file_check=file.check)
    health.succeeded()
    try:
        assert health.report()["status"] == "ok" and not health.failing
        path.unlink()
        report = health.report()
        assert health.failing and report["status"] == "failing"
        assert "was deleted" in str(report["last_error"]) and not health.lost  # not taken over yet
    finally:
        file.close()
