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
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from kvcanary.monitor.runs.replicas import HEARTBEAT_SECONDS, LEASE_SECONDS
from kvcanary.monitor.traffic.partitions import LEASE_SECONDS as STREAM_LEASE_SECONDS
from kvcanary.monitor.traffic.partitions import STEP_SECONDS as STREAM_STEP_SECONDS
from kvcanary.wire import VERSION
from tests.support import (
    REPO,
    WorkerProcess,
    free_port,
    own_database,
    stop_process,
    wait_http,
)
from tests.support.jetstream import StreamNames
from tests.support.services import wait_for

pytestmark = [pytest.mark.external_service, pytest.mark.slow]

TARGETS = 24
INTERVAL = 3.0
TOKEN = "replica-test-token-0123456789"


@pytest.fixture
def database_url() -> Iterator[str]:
    yield from own_database("kvcanary_replicas")


def start_replicas(
    tmp: Path,
    database_url: str,
    worker_url: str,
    count: int,
    interval: float = INTERVAL,
    traffic: dict[str, Any] | None = None,
) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``count`` replicas (``traffic``: the config's ``traffic`` block, if any)."""
    targets = [
        {"name": f"t{i:02d}", "base_url": worker_url, "engine": "reference", "model": "kvcanary-reference",
         "tenants": [{"name": "a"}, {"name": "b"}], "probes": ["canary"], "interval_seconds": interval,
         "gateway_api_bases": [f"http://10.0.0.{i + 1}:8000/v1"]}
        for i in range(TARGETS)
    ]  # fmt: skip
    env = {**os.environ, "KVCANARY_API_TOKEN": TOKEN}
    replicas = []
    for i in range(count):
        port = free_port()
        config = {"database_url": database_url, "api": {"listen": f"127.0.0.1:{port}"}, "targets": targets}
        if traffic is not None:
            config["traffic"] = traffic
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
        wait_for(
            lambda: (
                all(gauge(url, "kvcanary_replicas") == 3 for url, _ in replicas)
                and sum(gauge(url, "kvcanary_pairs_owned") for url, _ in replicas) == TARGETS
            ),
            6 * HEARTBEAT_SECONDS,
            "every replica to see the others and the pairs to be divided",
        )
        owned = [gauge(url, "kvcanary_pairs_owned") for url, _ in replicas]
        assert sum(owned) == TARGETS and min(owned) > 0, owned

        window_start = datetime.now().astimezone()
        time.sleep(6 * INTERVAL)
        counts = [len(v) for v in runs_by_pair(database_url, window_start).values()]
        # About once per interval overall: six intervals give six runs per pair, not eighteen (a
        # loaded machine may skip a tick or two, never add twelve).
        assert len(counts) == TARGETS and max(counts) <= 8 and min(counts) >= 3, sorted(counts)

        _, killed = replicas.pop(0)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(10)
        killed_at = datetime.now().astimezone()
        takeover = LEASE_SECONDS + HEARTBEAT_SECONDS + INTERVAL
        time.sleep(takeover + 3 * INTERVAL)
        after = runs_by_pair(database_url, killed_at)
        assert len(after) == TARGETS, f"pairs never probed after the kill: {TARGETS - len(after)}"
        worst = max((runs[0] - killed_at).total_seconds() for runs in after.values())
        # Plus a heartbeat's lag or a skipped tick on a loaded machine; a pair not taken over waits forever.
        limit = takeover + INTERVAL + 1
        assert worst <= limit, f"a pair waited {worst:.1f}s for a survivor (limit {limit:.0f}s)"
        assert sum(gauge(url, "kvcanary_pairs_owned") for url, _ in replicas) == TARGETS
    finally:
        for _, proc in replicas:
            stop_process(proc, timeout=30)


def test_each_deployments_traffic_is_judged_once_by_one_replica_whichever_receives_it(
    tmp_path: Path, database_url: str, start_worker: Callable[..., WorkerProcess], stream_names: StreamNames
) -> None:
    """One caller's text reaches replica 0, another caller's answer carrying it reaches replica 1:
    the overlap is caught for every deployment only if each deployment's window is in one place.
    Posts go to the stream (``traffic.source: jetstream``), whose partitions the two replicas share."""
    from kvcanary.tap.fingerprints import Fingerprinter
    from kvcanary.tap.record import Exchange, summarize

    worker = start_worker("--mode", "aggregated")
    jetstream = stream_names.config(ack_wait_seconds=3, duplicate_window_seconds=30)
    replicas = start_replicas(tmp_path, database_url, worker.url, 2, interval=600.0,
                              traffic={"source": "jetstream", "jetstream": jetstream})  # fmt: skip
    tap = Fingerprinter(b"replica-test-fingerprint-key-0123")
    text = Path("/usr/share/common-licenses/GPL-3").read_text()

    def batch(caller: str, i: int, prompt: str, response: str) -> dict[str, object]:
        base = f"http://10.0.0.{i + 1}:8000/v1"
        records = [summarize(Exchange(f"{caller}-{i}", time.time(), caller, "team", base, prompt=prompt,
                                      response=response), tap)]  # fmt: skip
        return {"version": VERSION, "batch": uuid.uuid4().hex, "gateway": "gw", "records": records}

    def post(url: str, body: dict[str, object]) -> dict[str, int]:
        answer = httpx.post(f"{url}/api/v1/traffic", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def judged(check: str, flagged: bool = False) -> list[float]:
        """Records each replica judged by ``check`` (``flagged``: only those it flagged)."""
        return [
            sum(v for labels, v in samples(url, "kvcanary_traffic_records_total")
                if labels["check"] == check and (labels["verdict"] != "pass" or not flagged))
            for url, _ in replicas
        ]  # fmt: skip

    try:
        wait_for(
            lambda: [len(stream_partitions(u)) for u, _ in replicas] in [[k, 16 - k] for k in range(1, 16)],
            6 * STREAM_LEASE_SECONDS + 30,
            "both replicas to share the stream's partitions",
        )
        sent = []
        for i in range(TARGETS):
            passage = text[1000 + 300 * i : 3000 + 300 * i]
            sent.append((replicas[1][0], batch("acme", i, passage, "Noted.")))
            assert post(replicas[0][0], sent[-1][1])["accepted"] == 1  # taken by the stream
            sent.append((replicas[0][0], batch("globex", i, "Summarize my notes.", "Sure: " + passage)))
            assert post(replicas[1][0], sent[-1][1])["accepted"] == 1
        wait_for(lambda: sum(judged("marker")) >= 2 * TARGETS, 60, "every record judged")
        assert sum(judged("overlap", flagged=True)) == TARGETS  # every deployment's window saw both callers
        for other, body in sent:  # each sent again, as a tap whose answer was lost, via the other replica
            post(other, body)
            post(other, {**body, "batch": uuid.uuid4().hex})  # and after the stream's duplicate window
        time.sleep(3 + 2 * STREAM_STEP_SECONDS)  # a record judged twice would be counted meanwhile
        # Once each (a record sent again through either replica is not judged again), and shared out.
        assert sum(judged("marker")) == 2 * TARGETS and min(judged("marker")) > 0, judged("marker")
    finally:
        for _, proc in replicas:
            stop_process(proc, timeout=30)


def stream_partitions(url: str) -> list[int]:
    try:
        return list(
            httpx.get(url + "/healthz", timeout=5).json().get("traffic_stream", {}).get("partitions", [])
        )
    except (httpx.HTTPError, ValueError):
        return []


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text_ = httpx.get(url + "/metrics", timeout=10).text
    return [
        (s.labels, s.value)
        for f in text_string_to_metric_families(text_)
        for s in f.samples
        if s.name == name
    ]
