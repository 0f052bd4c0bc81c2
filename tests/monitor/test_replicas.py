"""Three `kvcanary serve` replicas on one PostgreSQL divide the work; one killed, the others take it.

On main two replicas ran every probe twice. Here 24 targets are probed by three replicas: each
pair must run about once per interval overall (not three times), every replica must own some, and
after one replica is killed with SIGKILL (no goodbye, its heartbeat just stops) its pairs must go on
being probed within one lease plus a heartbeat and an interval.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import httpx
import psycopg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from monitor.runs.replicas import HEARTBEAT_SECONDS, LEASE_SECONDS
from tests.conftest import PG_HOST, PG_PORT, REPO, WorkerProcess, free_port, stop_process, wait_http

pytestmark = [pytest.mark.external_service, pytest.mark.slow]

TARGETS = 24
INTERVAL = 3.0


@pytest.fixture
def database_url() -> Iterator[str]:
    name = f"kvcanary_replicas_{uuid.uuid4().hex[:8]}"
    admin = f"host={PG_HOST} port={PG_PORT} user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_replicas(
    tmp: Path, database_url: str, worker_url: str, count: int
) -> list[tuple[str, subprocess.Popen[bytes]]]:
    targets = [
        {"name": f"t{i:02d}", "base_url": worker_url, "engine": "reference", "model": "kvcanary-reference",
         "tenants": [{"name": "a"}, {"name": "b"}], "probes": ["canary"], "interval_seconds": INTERVAL}
        for i in range(TARGETS)
    ]  # fmt: skip
    env = {**os.environ, "KVCANARY_API_TOKEN": "replica-test-token-0123456789"}
    replicas = []
    for i in range(count):
        port = free_port()
        config = {"database_url": database_url, "api": {"listen": f"127.0.0.1:{port}"}, "targets": targets}
        path = tmp / f"replica-{i}.yml"
        path.write_text(yaml.safe_dump(config))
        if i == 0:
            subprocess.run([sys.executable, "-m", "monitor", "db", "upgrade", "--config", str(path)],
                           check=True, cwd=REPO, env=env, capture_output=True, timeout=120)  # fmt: skip
        with (tmp / f"replica-{i}.log").open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "monitor", "serve", "--config", str(path)],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", timeout=60, proc=proc)
        replicas.append((url, proc))
    return replicas


def gauge(url: str, name: str) -> float:
    text_ = httpx.get(url + "/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text_) for s in f.samples if s.name == name)


def runs_by_pair(database_url: str, since: datetime) -> dict[str, list[datetime]]:
    engine = create_engine(database_url)
    query = text(
        "SELECT t.name, r.started_at FROM probe_result r JOIN target t ON t.id = r.target_id "
        "WHERE r.started_at >= :since ORDER BY r.started_at"
    )
    with engine.connect() as conn:
        rows = conn.execute(query, {"since": since}).all()
    engine.dispose()
    out: dict[str, list[datetime]] = defaultdict(list)
    for name, started in rows:
        out[name].append(started)
    return out


def test_three_replicas_share_the_work_and_survivors_take_over_a_killed_ones(
    tmp_path: Path, database_url: str, start_worker: Callable[..., WorkerProcess]
) -> None:
    worker = start_worker("--mode", "aggregated")
    replicas = start_replicas(tmp_path, database_url, worker.url, 3)
    try:
        time.sleep(HEARTBEAT_SECONDS * 2)  # every replica has seen the others
        owned = [gauge(url, "kvcanary_pairs_owned") for url, _ in replicas]
        assert sum(owned) == TARGETS and min(owned) > 0, owned
        assert all(gauge(url, "kvcanary_replicas") == 3 for url, _ in replicas)

        window_start = datetime.now().astimezone()
        time.sleep(6 * INTERVAL)
        counts = [len(v) for v in runs_by_pair(database_url, window_start).values()]
        # About once per interval overall: six intervals give six runs per pair, not eighteen.
        assert len(counts) == TARGETS and max(counts) <= 8 and min(counts) >= 4, sorted(counts)

        _, killed = replicas.pop(0)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(10)
        killed_at = datetime.now().astimezone()
        takeover = LEASE_SECONDS + HEARTBEAT_SECONDS + INTERVAL
        time.sleep(takeover + 3 * INTERVAL)
        after = runs_by_pair(database_url, killed_at)
        assert len(after) == TARGETS, f"pairs never probed after the kill: {TARGETS - len(after)}"
        worst = max((runs[0] - killed_at).total_seconds() for runs in after.values())
        assert worst <= takeover + 2, f"a pair waited {worst:.1f}s for a survivor (limit {takeover:.0f}s)"
        assert sum(gauge(url, "kvcanary_pairs_owned") for url, _ in replicas) == TARGETS
    finally:
        for _, proc in replicas:
            stop_process(proc, timeout=30)
