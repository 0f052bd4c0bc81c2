"""``kvcanary demo``: the disclosed incident, reproduced and caught on one machine.

Starts two reference workers as processes on free loopback ports — one healthy, one
disaggregated with the placeholder defect and a prefill pool smaller than its context window
(the incident's configuration) — and the monitor on SQLite with two tenants. It prints verdicts
as they arrive, then the incident with its redacted evidence, and keeps serving the REST API and
/metrics until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kvcanary.demo.containment import (
    contain_and_send_again,
    report_containment,
    signing_keys,
)
from kvcanary.demo.gateway import (
    Gateway,
    maybe_start_gateway,
    report_blast_radius,
    run_traffic,
)
from kvcanary.demo.printer import DemoPrinter
from kvcanary.demo.stack import Observability, missing_binaries, start_observability
from kvcanary.demo.stop import DemoServer, DemoStop
from kvcanary.monitor.app import Monitor
from kvcanary.monitor.config.settings import Settings, load_settings
from kvcanary.monitor.http_app import create_app
from kvcanary.monitor.storage.db import upgrade
from kvcanary.processes import free_port, stop_processes, wait_http

#: The reference worker, run as a module (the monitor starts workers only as processes).
WORKERS_MODULE = "kvcanary.workers"
TENANTS = ("tenant-a", "tenant-b")
WORKERS = {
    # name: worker flags. The defective node advertises 8,192 tokens of context on a 2,048-token
    # prefill pool and swaps over-capacity requests for a one-token placeholder (SGLang #30233).
    "healthy": ["--mode", "aggregated", "--kv-pool-tokens", "16384", "--context-window", "8192"],
    "defective": [
        "--mode",
        "disaggregated",
        "--admission",
        "placeholder",
        "--prefill-pool-tokens",
        "2048",
        "--decode-pool-tokens",
        "16384",
        "--context-window",
        "8192",
    ],
}
#: How the demo stops on Ctrl-C or SIGTERM, and the processes it started, for the watchdog.
STOP = DemoStop()
INTERVALS = {"canary": 5.0, "cross_tenant": 5.0, "boundary": 8.0, "counters": 5.0, "capacity": 10.0}


def _private_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def _start_worker(
    name: str, flags: list[str], keys_file: Path, workdir: Path
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    log = (workdir / f"worker-{name}.log").open("wb")
    argv = [
        sys.executable,
        "-m",
        WORKERS_MODULE,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-keys-file",
        str(keys_file),
        *flags,
    ]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return f"http://127.0.0.1:{port}", proc


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    wait_http(url + "/health", timeout, proc, every=0.2)


def demo_config(
    workdir: Path, urls: dict[str, str], port: int, signing_key: Path, alertmanager: str | None = None
) -> dict[str, Any]:
    """The demo's configuration, as ``kvcanary.yml`` in the workdir holds it."""
    base = f"http://127.0.0.1:{port}"
    return {
        "database_url": f"sqlite:///{workdir / 'kvcanary.db'}",
        "api": {
            "listen": f"127.0.0.1:{port}",
            "token_file": str(workdir / "api-token"),
            "public_url": base,
        },
        "alertmanagers": [alertmanager] if alertmanager else [],
        "alerting": {"resend_interval_seconds": 30, "poll_interval_seconds": 1},
        "targets": [
            {
                "name": name,
                "base_url": url,
                "engine": "reference",
                "model": "kvcanary-reference",
                "tenants": [{"name": t, "api_key_file": str(workdir / f"key-{t}")} for t in TENANTS],
                "interval_seconds": 5,
                "timeout_seconds": 20,
                "probes": list(INTERVALS),
                "probe_intervals": INTERVALS,
            }
            for name, url in urls.items()
        ],
        "incidents": {"resolve_after_passes": 3},
        # Recorded, not acted on, until the demo turns it on for the defective target
        # (gateway.contain_and_send_again: kvcanary.yml rewritten and reloaded).
        "containment": {"mode": "observe", "admission_guard": "observe"},
        # The monitor's half signs the set the gateway's tap takes (containment.signing_keys).
        "containment_signing": {"key_file": str(signing_key)},
        "spool": {"path": str(workdir / "spool")},
        "traffic": {"ingest_token_file": str(workdir / "ingest-token"), "pass_interval_seconds": 10},
    }


def write_config(path: Path, config: dict[str, Any]) -> Settings:
    """Write ``config`` to ``path`` (what a reload reads) and return its settings."""
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return load_settings(path)


async def _serve(
    monitor: Monitor,
    settings: Settings,
    printer: DemoPrinter,
    obs: Observability | None,
    duration: float | None,
    until_caught: bool,
    gateway: Gateway | None = None,
) -> None:
    server = DemoServer(create_app(monitor), settings, STOP)

    def done() -> bool:
        if obs is not None and printer.caught is not None:
            if printer.paged is None and (alerts := obs.alerts("KVCanaryLeak")):
                printer.page_seen(alerts[0])
            if printer.ruled is None and (alerts := obs.alerts("KVCanaryLeakDetected")):
                printer.rule_seen(alerts[0])
        paged = obs is None or (printer.paged is not None and printer.ruled is not None)
        return bool(printer.caught) and printer.healthy_green() and paged

    async def narrate() -> None:
        started = time.monotonic()
        while not server.should_exit:
            await asyncio.sleep(0.5)
            if await asyncio.to_thread(done):
                if gateway is not None:
                    caught = printer.caught.outcome if printer.caught else None
                    await report_blast_radius(
                        monitor, settings, caught.incident_id if caught else None, gateway
                    )
                await asyncio.to_thread(report_containment, monitor, gateway)
                if gateway is not None:
                    await contain_and_send_again(monitor, gateway)
                _where_to_look(settings, obs)
                server.should_exit = until_caught
                break
            if time.monotonic() - started > 120:
                print(
                    "  ... still waiting for a verdict on every probe; see the logs in the workdir",
                    flush=True,
                )
                break

    async def stop_after() -> None:
        deadline = None if duration is None else time.monotonic() + duration
        while not server.should_exit:
            if STOP.asked or (deadline is not None and time.monotonic() >= deadline):
                server.should_exit = True
            await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(narrate()), asyncio.create_task(stop_after())]
    if gateway is not None:
        tasks.append(asyncio.create_task(run_traffic(gateway)))
    await server.serve()
    for task in tasks:
        task.cancel()


def _where_to_look(settings: Settings, obs: Observability | None) -> None:
    base = f"http://{settings.api.listen}"
    token_file = settings.api.token_file
    print("=== healthy target is green; the monitor keeps running. Where to look: ===")
    if obs is not None:
        print(f"  Alertmanager (the page) : {obs.alertmanager_url}/#/alerts")
        print(f"  Prometheus (the rules)  : {obs.prometheus_url}/alerts")
        graph = "graph?g0.expr=kvcanary_probe_runs_total&g0.tab=0"
        print(f"  Prometheus (a graph)    : {obs.prometheus_url}/{graph}")
    print(f'  export KVCANARY_TOKEN="$(cat {token_file})"')
    print(f'  curl -s -H "Authorization: Bearer $KVCANARY_TOKEN" {base}/api/v1/incidents')
    print(f'  curl -s -H "Authorization: Bearer $KVCANARY_TOKEN" {base}/api/v1/targets')
    print(f"  curl -s {base}/metrics | grep ^kvcanary_")
    print(f"  OpenAPI: {base}/docs     runbooks: {base}/runbooks     database: {settings.database_url}")
    print("  Ctrl-C to stop.\n", flush=True)


def run_demo(*, duration: float | None, port: int, workdir: Path | None, until_caught: bool = False) -> int:
    """Run the demo; return 0 when the leak was caught and the healthy target stayed green."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvcanary-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keys = {t: secrets.token_urlsafe(24) for t in TENANTS}
    for tenant, key in keys.items():
        _private_file(workdir / f"key-{tenant}", key)
    gateway_key = secrets.token_urlsafe(24)  # the gateway's own key on the workers: tenant "customers"
    lines = [f"{k}={t}\n" for t, k in keys.items()] + [f"{gateway_key}=customers\n"]
    keys_file = _private_file(workdir / "worker-keys", "".join(lines))
    _private_file(workdir / "api-token", secrets.token_urlsafe(32))
    ingest_token = _private_file(workdir / "ingest-token", secrets.token_urlsafe(32)).read_text()
    print(f"kvcanary demo — workdir {workdir}", flush=True)
    procs: list[subprocess.Popen[bytes]] = []
    obs: Observability | None = None
    gateway: Gateway | None = None
    STOP.install()  # Ctrl-C and SIGTERM: the demo stops in order (stop.py)
    try:
        urls = {}
        for name, flags in WORKERS.items():
            url, proc = _start_worker(name, flags, keys_file, workdir)
            procs.append(proc)
            STOP.children.append(proc)
            urls[name] = url
        for (name, url), proc in zip(urls.items(), procs, strict=True):
            _wait_ready(url, proc)
            print(f"  worker {name:<9} {url}  {' '.join(WORKERS[name])}", flush=True)
        signing = signing_keys(workdir)
        gateway = maybe_start_gateway(workdir, urls, gateway_key, port, ingest_token, signing.public)
        STOP.children.extend([gateway.proc] if gateway is not None else [])
        obs = _observability(workdir, port, urls)
        STOP.children.extend(obs.procs if obs is not None else [])
        config_path = workdir / "kvcanary.yml"
        config = demo_config(workdir, urls, port, signing.private, obs.alertmanager_url if obs else None)
        settings = write_config(config_path, config)
        upgrade(settings.database_url)
        printer = DemoPrinter(INTERVALS)
        monitor = Monitor.open(settings, on_summary=printer, config_path=config_path)
        print(f"  monitor   http://127.0.0.1:{port}  probes {', '.join(INTERVALS)}\n", flush=True)
        asyncio.run(_serve(monitor, settings, printer, obs, duration, until_caught, gateway))
        STOP.exit_if_terminated()
        code, line = printer.closing(paged=None if obs is None else printer.paged is not None)
        print(line, flush=True)
        return code
    finally:  # all at once: a SIGTERM'd demo is gone within one grace, however loaded the machine
        stop_processes(list(STOP.children))


def _observability(workdir: Path, port: int, urls: dict[str, str]) -> Observability | None:
    """Start Prometheus and Alertmanager when installed; otherwise say what the demo skips."""
    if missing := missing_binaries():
        print(f"  (skipped: {' and '.join(missing)} not installed — no page, no rules; scripts/demo.sh "
              "installs them on Debian)", flush=True)  # fmt: skip
        return None
    try:
        obs = start_observability(workdir, port, urls)
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"  (skipped Prometheus and Alertmanager: {exc})", flush=True)
        return None
    print(
        f"  alertmanager {obs.alertmanager_url}   prometheus {obs.prometheus_url}",
        flush=True,
    )
    return obs
