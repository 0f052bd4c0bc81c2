"""End to end: `kvcanary serve` as a process against reference workers as processes.

The defective worker (disaggregated, placeholder admission, prefill pool smaller than the
context window) must open a critical incident that shows over REST; the healthy one none;
restarting the defective worker fixed must resolve it. On SQLite and on real PostgreSQL.
No API key may appear in logs, the database or API responses.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.monitor.served import spawn_serve
from tests.support import REPO, WorkerProcess, free_port, stop_process, wait_http
from tests.support.pace import PROCESS_SECONDS

DEFECTIVE = [
    "--mode",
    "disaggregated",
    "--admission",
    "placeholder",
    "--prefill-pool-tokens",
    "1024",
    "--decode-pool-tokens",
    "8192",
    "--context-window",
    "8192",
]
FIXED = [
    "--mode",
    "disaggregated",
    "--admission",
    "reject",
    "--prefill-pool-tokens",
    "1024",
    "--decode-pool-tokens",
    "8192",
    "--context-window",
    "8192",
]
HEALTHY = ["--mode", "aggregated", "--kv-pool-tokens", "8192", "--context-window", "4096"]
INTERVALS = {"canary": 1.0, "cross_tenant": 1.0, "boundary": 1.5}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.external_service)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kvcanary.db'}"
    return str(request.getfixturevalue("postgres_url"))


class Deployment:
    """Two workers, the monitor process, its config and its secrets."""

    def __init__(self, tmp: Path, database_url: str, start_worker: Callable[..., WorkerProcess]):
        self.tmp = tmp
        self.suffix = uuid.uuid4().hex[:6]
        self.keys = {"tenant-a": "sk-a-" + secrets.token_hex(12), "tenant-b": "sk-b-" + secrets.token_hex(12)}
        self.token = secrets.token_urlsafe(24)
        self.keys_file = tmp / "worker-keys"
        self.keys_file.write_text("".join(f"{k}={t}\n" for t, k in self.keys.items()))
        self.start_worker = start_worker
        self.healthy = start_worker(*HEALTHY, "--api-keys-file", str(self.keys_file))
        self.defective = start_worker(*DEFECTIVE, "--api-keys-file", str(self.keys_file))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "KVCANARY_API_TOKEN": self.token,
            "KVC_A": self.keys["tenant-a"],
            "KVC_B": self.keys["tenant-b"],
        }
        self.config = tmp / "kvcanary.yml"
        self.config.write_text(yaml.safe_dump(self._config(database_url)))
        self.log = tmp / "monitor.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def name(self, role: str) -> str:
        return f"{role}-{self.suffix}"

    def _config(self, database_url: str) -> dict[str, Any]:
        tenants = [{"name": "tenant-a", "api_key_env": "KVC_A"}, {"name": "tenant-b", "api_key_env": "KVC_B"}]
        return {
            "database_url": database_url,
            "api": {"listen": f"127.0.0.1:{self.port}"},
            "incidents": {"resolve_after_passes": 2},
            "scheduler": {"jitter_seconds": 0.2},
            "targets": [
                {
                    "name": self.name(role),
                    "base_url": w.url,
                    "engine": "reference",
                    "model": "kvcanary-reference",
                    "tenants": tenants,
                    "interval_seconds": 1,
                    "timeout_seconds": 15,
                    "probes": list(INTERVALS),
                    "probe_intervals": INTERVALS,
                }
                for role, w in (("healthy", self.healthy), ("defective", self.defective))
            ],
        }

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        # A failed assertion must not leave `kvcanary serve` running after the test.
        if self.proc is not None:
            stop_process(self.proc)

    def kvcanary(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "monitor", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=self.env,
            timeout=PROCESS_SECONDS,
        )

    def serve(self) -> None:
        self.proc = spawn_serve(self.config, self.env, self.log)
        wait_http(self.url + "/healthz", timeout=60, proc=self.proc)

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(
            self.url + path, params=params, headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )
        assert r.status_code == 200, r.text
        return r.json()

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(
            f"timed out waiting for {what}\n--- monitor log ---\n{self.log.read_text()[-4000:]}"
        )


@pytest.fixture
def deployment(
    tmp_path: Path, database_url: str, start_worker: Callable[..., WorkerProcess]
) -> Iterator[Deployment]:
    with Deployment(tmp_path, database_url, start_worker) as dep:
        yield dep


def open_incidents(dep: Deployment, role: str) -> list[dict[str, Any]]:
    return list(dep.api("/api/v1/incidents", target=dep.name(role), state="open")["items"])


@pytest.mark.slow
def test_the_defective_target_opens_a_critical_incident_that_resolves_once_fixed(
    deployment: Deployment,
) -> None:
    dep = deployment
    assert dep.kvcanary("db", "upgrade", "--config", str(dep.config)).returncode == 0
    dep.serve()

    incidents = dep.wait_for(
        "a critical incident on the defective target",
        lambda: [i for i in open_incidents(dep, "defective") if i["severity"] == "critical"],
    )
    incident = dep.api(f"/api/v1/incidents/{incidents[0]['id']}")
    assert incident["state"] == "open"
    assert "leak" in str(incident).lower()

    # The healthy target is judged, and judged green.
    def healthy_judged() -> bool:
        targets = {t["name"]: t for t in dep.api("/api/v1/targets")["items"]}
        last = targets[dep.name("healthy")]["last_verdicts"]
        return len(last) == len(INTERVALS) and all(v["verdict"] == "pass" for v in last.values())

    dep.wait_for("every healthy probe to pass", healthy_judged)
    assert open_incidents(dep, "healthy") == []

    metrics = httpx.get(dep.url + "/metrics", timeout=10).text
    assert f'kvcanary_cross_tenant_leaks_total{{target="{dep.name("defective")}"}}' in metrics
    assert (
        f'kvcanary_incidents_open{{certainty="certain",node="",probe="{incidents[0]["probe"]}",'
        f'severity="critical",target="{dep.name("defective")}"}} 1.0' in metrics
    )

    # Restart the defective worker with the fix on the same port: the incident resolves.
    port = dep.defective.port
    dep.defective.stop()
    dep.start_worker(*FIXED, "--api-keys-file", str(dep.keys_file), port=port)
    dep.wait_for("the incidents to resolve", lambda: open_incidents(dep, "defective") == [], timeout=90)
    resolved = dep.api(f"/api/v1/incidents/{incidents[0]['id']}")
    assert resolved["state"] == "resolved"

    # A manual run through the API runs every probe of the target and reports the verdicts.
    ran = httpx.post(
        f"{dep.url}/api/v1/targets/{dep.name('healthy')}/run",
        params={"wait": 110},  # every probe of the target: past the default 30 s on a loaded machine
        headers={"Authorization": f"Bearer {dep.token}"},
        timeout=120,
    )
    assert ran.status_code == 200, ran.text
    assert sorted(r["probe"] for r in ran.json()["results"]) == sorted(INTERVALS)

    assert_no_secret_anywhere(dep)

    # SIGTERM drains cleanly. (uvicorn re-raises the signal after its graceful shutdown, so the
    # exit status is the signal's; the log says whether the drain completed.)
    assert dep.proc is not None
    stop_process(dep.proc, timeout=30)
    log = dep.log.read_text()
    assert dep.proc.returncode in (0, -15), log[-3000:]
    assert "kvcanary stopped cleanly" in log
    assert "Traceback" not in log and "CancelledError" not in log


def assert_no_secret_anywhere(dep: Deployment) -> None:
    """No API key (tenant keys, the REST token) in logs, the database or API responses."""
    secrets_ = [*dep.keys.values(), dep.token]
    haystacks = {"monitor log": dep.log.read_text(errors="replace")}
    for path in ("/api/v1/incidents", "/api/v1/probe-results", "/api/v1/targets", "/openapi.json"):
        haystacks[path] = httpx.get(
            dep.url + path,
            params={"limit": 500} if "v1/" in path else None,
            headers={"Authorization": f"Bearer {dep.token}"},
            timeout=10,
        ).text
    haystacks["database"] = dump_database(yaml.safe_load(dep.config.read_text())["database_url"])
    for where, text in haystacks.items():
        for secret in secrets_:
            assert secret not in text, f"a secret leaked into the {where}"


def dump_database(url: str) -> str:
    from sqlalchemy import MetaData, create_engine, select

    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine)
    with engine.connect() as conn:
        rows = [repr(row) for table in meta.sorted_tables for row in conn.execute(select(table))]
    engine.dispose()
    assert rows, "the database holds no rows at all"
    return "\n".join(rows)


def test_serve_refuses_an_unmigrated_database(
    tmp_path: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    dep = Deployment(tmp_path, f"sqlite:///{tmp_path / 'fresh.db'}", start_worker)
    proc = dep.kvcanary("serve", "--config", str(dep.config))
    assert proc.returncode == 2
    assert "kvcanary db upgrade" in proc.stderr
