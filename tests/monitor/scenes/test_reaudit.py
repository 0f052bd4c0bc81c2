"""Re-audit on change: a node restarted with a new configuration is audited again within seconds.

`kvcanary serve` runs against a reference worker in the incident's configuration (prefill pool far
below the context window, placeholder admission); `version` and `boundary` are scheduled an hour
apart, `capacity` every second. The worker is restarted on the same port with a fixed configuration:
the capacity audit sees the fingerprint change, records what changed (as an event on the open
incident too), and the monitor runs `version` and `boundary` at once instead of an hour later.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support import REPO, WorkerProcess, free_port, stop_process, wait_http
from tests.support.pace import PROCESS_SECONDS
from tests.support.services import wait_for

POOL = ["--mode", "disaggregated", "--context-window", "8192", "--decode-pool-tokens", "16384"]
BEFORE = [*POOL, "--prefill-pool-tokens", "1024", "--admission", "placeholder"]
AFTER = [*POOL, "--prefill-pool-tokens", "16384", "--admission", "reject"]
INTERVALS = {"capacity": 1.0, "version": 3600.0, "boundary": 3600.0}
#: A second target on the same node that sizes plants by the capacity and runs no boundary audit
#: (which would read the capacity afresh anyway).
PLANTING = {"capacity": 1.0, "cross_tenant": 2.0}
TOKEN = "reaudit-test-token-0123456789"


@pytest.fixture
def monitor(tmp_path: Path, start_worker: Callable[..., WorkerProcess]) -> Iterator[dict[str, Any]]:
    worker = start_worker(*BEFORE)
    port = free_port()
    config = {
        "database_url": f"sqlite:///{tmp_path / 'kvcanary.db'}",
        "api": {"listen": f"127.0.0.1:{port}"},
        "scheduler": {"jitter_seconds": 0.1},
        "targets": [
            {
                "name": "glm",
                "base_url": worker.url,
                "engine": "reference",
                "model": "kvcanary-reference",
                "tenants": [{"name": "a"}, {"name": "b"}],
                "probes": list(INTERVALS),
                "probe_intervals": INTERVALS,
                "timeout_seconds": 15,
            },
            {
                "name": "glm-plants",
                "base_url": worker.url,
                "engine": "reference",
                "model": "kvcanary-reference",
                "tenants": [{"name": "a"}, {"name": "b"}],
                "probes": list(PLANTING),
                "probe_intervals": PLANTING,
                "timeout_seconds": 15,
            },
        ],
    }
    path = tmp_path / "kvcanary.yml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "KVCANARY_API_TOKEN": TOKEN}
    run = [sys.executable, "-m", "monitor"]
    subprocess.run(
        [*run, "db", "upgrade", "--config", str(path)], check=True, cwd=REPO, env=env, timeout=PROCESS_SECONDS
    )
    log = tmp_path / "monitor.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*run, "serve", "--config", str(path)], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, env=env, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", timeout=60, proc=proc)
    yield {"url": url, "worker": worker, "log": log, "start_worker": start_worker}
    stop_process(proc, timeout=30)


def results(url: str, probe: str, target: str = "glm") -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    params = {"probe": probe, "target": target, "limit": 500}
    response = httpx.get(f"{url}/api/v1/probe-results", params=params, headers=headers)
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


def newest_plant_chars(url: str) -> int:
    """Return the planting size the newest cross_tenant run states in its detail (0 if none)."""
    found = [
        re.search(r"plants of (\d+) characters", r["detail"])
        for r in results(url, "cross_tenant", "glm-plants")[:1]
    ]
    return int(found[0].group(1)) if found and found[0] else 0


def api(url: str, path: str, **params: Any) -> Any:
    response = httpx.get(url + path, params=params, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_node_restarted_with_a_new_configuration_is_audited_again_at_once(monitor: dict[str, Any]) -> None:
    url, worker = monitor["url"], monitor["worker"]
    # First runs are spread over each interval: version and boundary may not have run at all yet.
    wait_for(lambda: len(results(url, "capacity")) >= 2, 60, "the first capacity audits")
    before = {p: len(results(url, p)) for p in ("version", "boundary")}
    wait_for(lambda: newest_plant_chars(url) == 1023 // 4, 30, "plants sized by the pool")
    mismatch = results(url, "capacity")[0]
    assert mismatch["verdict"] == "mismatch" and mismatch["reason"] == "pool_below_context_window"

    worker.stop()
    monitor["start_worker"](*AFTER, port=worker.port)
    restarted = time.monotonic()

    changed = wait_for(
        lambda: [r for r in results(url, "capacity") if "config_change" in r["evidence"]], 30, "the change"
    )
    change = changed[0]["evidence"]["config_change"]["changed"]
    assert change["pool.prefill"] == ["1024", "16384"] and change["fact.admission"] == [
        "placeholder",
        "reject",
    ]
    wait_for(
        lambda: all(len(results(url, p)) > before[p] for p in before), 30, "version and boundary to run again"
    )
    elapsed = time.monotonic() - restarted
    assert elapsed < 120  # not the hour their interval says (two waits of up to 30 s each above)
    assert results(url, "boundary")[0]["verdict"] == "pass"  # the fixed node refuses over-capacity prompts
    assert "configuration of glm changed: re-auditing version, boundary now" in monitor["log"].read_text()
    # cross_tenant sizes its plants by a capacity reading it keeps ten minutes: the change its own
    # target's capacity audit saw drops it, so plants grow with the new pool within seconds (they
    # were a quarter of the 1,023-token limit).
    wait_for(lambda: newest_plant_chars(url) > 1023 // 4, 20, "plants sized by the new pool")
    # The open capacity incident's timeline says when the deployment changed, and points at the audit.
    (incident,) = api(url, "/api/v1/incidents", target="glm", probe="capacity")["items"]
    events = api(url, f"/api/v1/incidents/{incident['id']}")["events"]
    noted = [e for e in events if e["kind"] == "config_changed"]
    assert len(noted) == 1 and noted[0]["probe_result_id"] == changed[-1]["id"], events
