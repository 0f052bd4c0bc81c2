"""Run-now requests and SIGTERM, through `kvcanary serve` as a process.

On main, 100 run-now requests whose clients gave up after 2 s made the monitor run 373 probes
(~2,335 requests) against one target; and SIGTERM with a run-now in flight against a hung target
took 365 s to exit, probing on meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.monitor.runs.run_now import RunNow
from tests.support import REPO, WorkerProcess, free_port, stop_process, wait_http
from tests.support.pace import PROCESS_SECONDS

TOKEN = "run-now-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def serve(tmp: Path, base_url: str, **api: Any) -> tuple[str, subprocess.Popen[bytes], Path]:
    port = free_port()
    config = {
        "database_url": f"sqlite:///{tmp / 'kvcanary.db'}",
        "api": {"listen": f"127.0.0.1:{port}", **api},
        "targets": [
            {
                "name": "t",
                "base_url": base_url,
                "engine": "reference",
                "model": "kvcanary-reference",
                "tenants": [{"name": "a"}, {"name": "b"}],
                "probes": ["canary"],
                "probe_intervals": {"canary": 86400},  # only run-now requests run it here
                "timeout_seconds": 30,
            }
        ],
    }
    path = tmp / "kvcanary.yml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "KVCANARY_API_TOKEN": TOKEN}
    run = [sys.executable, "-m", "monitor"]
    subprocess.run(
        [*run, "db", "upgrade", "--config", str(path)], check=True, cwd=REPO, env=env, timeout=PROCESS_SECONDS
    )
    log = tmp / "monitor.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*run, "serve", "--config", str(path)], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, env=env, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", timeout=60, proc=proc)
    return url, proc, log


def completions_served(worker_url: str) -> float:
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvcanary_requests_total"
    )


def test_a_flood_of_run_now_requests_runs_the_target_once(
    tmp_path: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    worker = start_worker("--mode", "aggregated")
    url, proc, _ = serve(tmp_path, worker.url, run_now_min_interval_seconds=30)
    try:
        before = completions_served(worker.url)

        def ask(_: int) -> int:
            try:
                return httpx.post(f"{url}/api/v1/targets/t/run", headers=AUTH, timeout=2).status_code
            except httpx.TimeoutException:
                return 0  # the client gave up: that must cancel nothing and repeat nothing

        with ThreadPoolExecutor(max_workers=20) as pool:
            codes = list(pool.map(ask, range(100)))
        # The run ends at the machine's pace; once it has, the next ask is told to come back later.
        deadline = time.monotonic() + 60
        while completions_served(worker.url) - before < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        later = ask(100)
        time.sleep(2)  # a second run, had the flood started one, would have served by now
        served = completions_served(worker.url) - before
    finally:
        stop_process(proc, timeout=30)
    assert set(codes) <= {0, 200, 202, 429}, codes
    assert later == 429, later
    assert served == 2, served  # one canary run: one completion per tenant


@pytest.fixture
def hung_target() -> Iterator[str]:
    """A port that accepts connections and never answers a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    for conn in held:
        conn.close()
    listener.close()


def test_sigterm_with_a_run_in_flight_against_a_hung_target_exits_within_seconds(
    tmp_path: Path, hung_target: str
) -> None:
    url, proc, log = serve(tmp_path, hung_target, shutdown_grace_seconds=5)
    waiting = threading.Thread(
        target=lambda: httpx.post(f"{url}/api/v1/targets/t/run?wait=120", headers=AUTH, timeout=200),
        daemon=True,
    )
    waiting.start()
    time.sleep(1.5)  # the run is in flight, stuck on the hung target
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    took = time.monotonic() - started
    print(f"\nSIGTERM with a run in flight on a hung target, grace 5 s: exited in {took:.1f}s")
    text = log.read_text()
    # One grace from the signal, shared by open requests and runs in flight (not one each: twice
    # the grace and more); the rest is cancelling, closing the writer and the interpreter's exit.
    assert took < 5 + 4, f"took {took:.1f}s to exit\n{text[-2000:]}"
    assert "stopping: no new probe runs" in text and "kvcanary stopped cleanly" in text


def test_a_run_is_done_only_once_its_results_are_in() -> None:
    """In the loop turn between a run's task ending and its results being recorded, a request must
    join it (not start a second run past the rate limit) and a reader must not see "done" and no results."""
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        async def run_target(name: str) -> list[dict[str, Any]]:
            loop.call_soon(in_between)
            return [{"verdict": "pass"}]

        now = RunNow(run_target, min_interval=60)

        def in_between() -> None:  # queued before the task's done-callbacks: runs in the gap
            job = now.get("t", first.id)
            assert job is not None
            seen["done"], seen["results"] = job.done, list(job.results)
            seen["again"] = now.request("t")[1]

        first, _ = now.request("t")
        assert await now.wait(first, 5)
        assert first.results == [{"verdict": "pass"}]

    asyncio.run(scenario())
    assert seen["again"] is False  # joined the run it found, started nothing
    assert not seen["done"] or seen["results"]


def test_sigterm_during_start_up_starts_no_probe_clock(tmp_path: Path) -> None:
    """A signal that lands while the app is still starting: the scheduler must not start after it."""
    from kvcanary.monitor.app import Monitor
    from kvcanary.monitor.config.settings import parse_settings
    from kvcanary.monitor.storage.db import upgrade

    url = f"sqlite:///{tmp_path / 'k.db'}"
    upgrade(url)
    target = {"name": "t", "base_url": "http://127.0.0.1:9", "engine": "reference",
              "tenants": [{"name": "a"}, {"name": "b"}], "probes": ["canary"]}  # fmt: skip
    config = {
        "database_url": url,
        "api": {"local_only": True},
        "spool": {"in_memory": True},
        "targets": [target],
    }
    monitor = Monitor.open(parse_settings(config))

    async def signalled_while_starting() -> bool:
        monitor.begin_shutdown()
        monitor.start()
        return bool(monitor.scheduler.running)

    assert asyncio.run(signalled_while_starting()) is False
