"""The SQLite database on a full disk: `/healthz` and `kvcanary_database_up` say so while every write
fails, results wait in the spool (on another disk), and all of them land once there is room.

On main: every write failed for 100 s while `/healthz` stayed 200 and `kvcanary_database_up` 1.
The disk is a small tmpfs of the test's own (root may mount one; elsewhere the test is skipped).
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import FakeEngine
from tests.support.loopback import Loopback

pytestmark = [pytest.mark.slow]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = Path("/tmp") / f"kvcanary-disk-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)
    mount.rmdir()


def fill(disk: Path) -> Path:
    """Write a file until the disk is full; return it."""
    filler = disk / "filler"
    # Unbuffered: a buffered file still holds the write that failed, and closing it tries that
    # write again and raises ENOSPC out of the `with`.
    with filler.open("wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * 65536)
        except OSError:
            pass
    return filler


def test_a_full_disk_turns_health_red_and_nothing_is_lost(
    served: Callable[[dict[str, Any]], Served], small_disk: Path
) -> None:
    server = Loopback(FakeEngine())
    target = reference_target("ok", server.url, probes=["canary"], interval_seconds=0.3)
    monitor = served({"database_url": f"sqlite:///{small_disk / 'kvcanary.db'}", "targets": [target]})
    try:
        monitor.start()
        monitor.wait_for(
            "results written",
            lambda: (monitor.value("kvcanary_database_last_write_success_timestamp_seconds") or 0) > 0,
        )
        filler = fill(small_disk)
        monitor.wait_for(
            "results to wait in the spool", lambda: (monitor.value("kvcanary_spool_results") or 0) >= 5
        )
        answer = httpx.get(monitor.url + "/healthz", timeout=10)
        assert answer.status_code == 503 and answer.json()["database"] == "unwritable", answer.text
        assert answer.json()["writes"]["last_error"] == "OperationalError"
        assert monitor.value("kvcanary_database_up") == 0
        assert all(v == 0 for _, v in monitor.samples("kvcanary_results_dropped_total"))

        filler.unlink()
        monitor.wait_for(
            "the spool to drain", lambda: monitor.value("kvcanary_spool_results") == 0, timeout=30
        )
        monitor.wait_for(
            "health to come back", lambda: httpx.get(monitor.url + "/healthz", timeout=10).status_code == 200
        )
        assert monitor.value("kvcanary_database_up") == 1
    finally:
        monitor.stop()
        server.close()
