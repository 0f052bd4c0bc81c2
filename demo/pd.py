"""``kvcanary demo --topology pd``: the disclosed incident's own topology, on one machine.

SGLang's model gateway (``sglang-router`` in PD mode, its ``cache_aware`` policy) in front of two
prefill and two decode reference servers, the KV handed from prefill to decode over a socket keyed
by the gateway's bootstrap room. Prefill ``small`` has the incident's configuration: a 2,048-token
pool under an 8,192-token context window, and an over-capacity request swapped for a one-token
placeholder instead of refused; prefill ``roomy`` holds twice the window and refuses what it cannot
hold. kvcanary is given only the gateway's URL: it finds the four nodes from ``GET /workers``,
audits each prefill pool against the window, and sends its path probes down each of the four
prefill x decode pairs itself, as the gateway would, so the bad node is judged however the gateway's
policy routes customers (``cache_aware`` keeps one prompt on one pair). It prints the nodes found,
the verdict of every path, the incident naming the leaking pair, and how soon every path was judged.

Needs the gateway's venv (``scripts/setup-sglang-router.sh``, which ``demo.sh --topology pd``
runs); without it the demo says so and exits 1.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvcanary.demo.stop import DemoServer, DemoStop
from kvcanary.monitor.app import Monitor
from kvcanary.monitor.config.settings import Settings, parse_settings
from kvcanary.monitor.config.targets import PATH_KINDS
from kvcanary.monitor.http_app import create_app
from kvcanary.monitor.runs.runner import RunSummary
from kvcanary.monitor.storage.db import upgrade
from kvcanary.processes import free_port, stop_processes, wait_http

WORKERS_MODULE = "kvcanary.workers"
TENANTS = ("tenant-a", "tenant-b")
COMMON = ["--page-size", "16", "--context-window", "8192"]
PREFILLS = {  # name: (admission, pool): the incident's node, and a sound one
    "small": ["--admission", "placeholder", "--prefill-pool-tokens", "2048"],
    "roomy": ["--admission", "reject", "--prefill-pool-tokens", "16384"],
}
DECODES = ("d0", "d1")
DECODE_FLAGS = ["--decode-pool-tokens", "16384"]
#: Seconds between runs of each kind: a path is judged within one of these of being found.
INTERVAL = 10.0
KINDS = {"canary": INTERVAL, "boundary": INTERVAL, "capacity": INTERVAL}
POLICY = "cache_aware"
#: How the demo stops on Ctrl-C or SIGTERM, and the processes it started, for the watchdog.
STOP = DemoStop()


def router_python() -> Path | None:
    """The gateway's Python, where ``scripts/setup-sglang-router.sh`` finished its venv."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcanary"
    venv = Path(os.environ.get("KVCANARY_SGLANG_ROUTER_VENV") or cache / "venv-sglang-router")
    python = venv / "bin" / "python"
    return python if python.exists() and (venv / ".kvcanary-setup").exists() else None


@dataclass
class Fleet:
    """The servers and the gateway, by the demo's names."""

    urls: dict[str, str] = field(default_factory=dict)  # name -> URL
    bootstrap: dict[str, int] = field(default_factory=dict)  # prefill name -> bootstrap port
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    gateway: str = ""

    def name_of(self, node: str) -> str:
        """The demo's name of a node or path as kvcanary names it (``prefill-127.0.0.1-PORT``,
        ``prefill-...--decode-...``): ``small``, ``small -> d0``."""
        by_port = {url.rsplit(":", 1)[1]: name for name, url in self.urls.items()}
        named = re.sub(r"(?:prefill|decode)-127\.0\.0\.1-(\d+)", lambda m: by_port.get(m[1], m[0]), node)
        return named.replace("--", " -> ")


def _start(name: str, flags: list[str], keys: Path, workdir: Path, fleet: Fleet) -> None:
    port = free_port()
    argv = [sys.executable, "-m", WORKERS_MODULE, "--host", "127.0.0.1", "--port", str(port),
            "--api-keys-file", str(keys), *COMMON, *flags]  # fmt: skip
    fleet.procs.append(_spawn(argv, workdir / f"worker-{name}.log"))
    fleet.urls[name] = f"http://127.0.0.1:{port}"


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start_fleet(python: Path, keys: Path, workdir: Path, fleet: Fleet) -> None:
    """Start the four servers, wait for them, then the gateway in front of them; ``fleet`` holds
    each process as it starts, so that a failure midway stops what had started."""
    for name, flags in PREFILLS.items():
        fleet.bootstrap[name] = free_port()
        _start(name, ["--mode", "prefill", "--bootstrap-port", str(fleet.bootstrap[name]), *flags], keys,
               workdir, fleet)  # fmt: skip
    for name in DECODES:
        _start(name, ["--mode", "decode", *DECODE_FLAGS], keys, workdir, fleet)
    for (name, url), proc in zip(fleet.urls.items(), fleet.procs, strict=True):
        wait_http(url + "/health", 90, proc, every=0.2)
        print(f"  {'prefill' if name in PREFILLS else 'decode':<7} {name:<5} {url}", flush=True)
    port = free_port()
    argv = [str(python), "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for name in PREFILLS:
        argv += ["--prefill", fleet.urls[name], str(fleet.bootstrap[name])]
    for name in DECODES:
        argv += ["--decode", fleet.urls[name]]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", POLICY,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    fleet.procs.append(_spawn(argv, workdir / "gateway.log"))
    fleet.gateway = f"http://127.0.0.1:{port}"
    wait_http(fleet.gateway + "/health", 60, fleet.procs[-1], every=0.2)
    print(f"  gateway {fleet.gateway}  sglang-router, PD mode, policy {POLICY}\n", flush=True)


def pd_settings(workdir: Path, gateway: str, port: int) -> Settings:
    """One target: the gateway's URL, and nothing of its nodes."""
    return parse_settings(
        {
            "database_url": f"sqlite:///{workdir / 'kvcanary.db'}",
            "api": {"listen": f"127.0.0.1:{port}", "token_file": str(workdir / "api-token")},
            "targets": [
                {
                    "name": "incident",
                    "base_url": gateway,
                    "sglang_router": gateway,
                    # The demo's servers are all on loopback: the nodes the gateway lists are the
                    # operator's own, so the tenants' keys may go to them (docs/operating.md).
                    "credential_hosts": ["127.0.0.1"],
                    "discovery_interval_seconds": 2.0,
                    "engine": "reference",
                    "model": "kvcanary-reference",
                    "tenants": [{"name": t, "api_key_file": str(workdir / f"key-{t}")} for t in TENANTS],
                    "timeout_seconds": 20,
                    "probes": list(KINDS),
                    "probe_intervals": KINDS,
                }
            ],
            "scheduler": {"jitter_seconds": 0.5},
            "spool": {"path": str(workdir / "spool")},
        },
        source="demo --topology pd",
    )


@dataclass
class PathPrinter:
    """Prints each verdict change per node or path; knows when every path has been judged."""

    fleet: Fleet
    began: float = field(default_factory=time.monotonic)
    last: dict[tuple[str, str], RunSummary] = field(default_factory=dict)
    covered_after: float | None = None

    def __call__(self, summary: RunSummary) -> None:
        key = (summary.node, summary.kind)
        before = self.last.get(key)
        self.last[key] = summary
        verdict = summary.result.verdict.value
        if before is None or before.result.verdict.value != verdict:
            where = self.fleet.name_of(summary.node) if summary.node else "through the gateway"
            print(f"  [{verdict:<8}] {where:<22} {summary.kind:<9} {summary.result.reason}", flush=True)
        if self.covered_after is None and self.every_path_judged():
            self.covered_after = time.monotonic() - self.began

    def paths(self) -> dict[str, dict[str, RunSummary]]:
        found: dict[str, dict[str, RunSummary]] = {}
        for (node, kind), summary in self.last.items():
            if "--" in node and kind in PATH_KINDS:
                found.setdefault(node, {})[kind] = summary
        return found

    def every_path_judged(self) -> bool:
        paths = self.paths()
        complete = all(len(kinds) == len(PATH_KINDS) for kinds in paths.values())
        return len(paths) == len(PREFILLS) * len(DECODES) and complete

    def report(self) -> None:
        print(f"\n=== THE INCIDENT'S TOPOLOGY, given only the gateway's URL ({self.fleet.gateway}) ===")
        for (node, kind), s in sorted(self.last.items(), key=lambda item: self.fleet.name_of(item[0][0])):
            if kind == "capacity" and node:
                print(f"  node  {self.fleet.name_of(node):<22} capacity {s.result.verdict.value:<8} "
                      f"{s.result.reason}")  # fmt: skip
        for path, kinds in sorted(self.paths().items(), key=lambda item: self.fleet.name_of(item[0])):
            said = "  ".join(f"{k} {s.result.verdict.value}" for k, s in sorted(kinds.items()))
            print(f"  path  {self.fleet.name_of(path):<22} {said}")
        for (node, kind), s in sorted(self.last.items()):
            failed = s.result.verdict.value in ("leak", "mismatch")
            if "--" in node and failed and s.outcome is not None and s.outcome.incident_id:
                print(f"  incident #{s.outcome.incident_id} ({s.outcome.severity}): {kind} on the pair "
                      f"{self.fleet.name_of(node)}: {s.result.reason}")  # fmt: skip
        if self.covered_after is not None:
            print(f"  coverage: all {len(PREFILLS) * len(DECODES)} prefill x decode paths judged "
                  f"{self.covered_after:.0f}s after the monitor started (bound: the nodes found within "
                  f"2 s, then one {INTERVAL:.0f}s interval)")  # fmt: skip
        print("", flush=True)

    def caught(self) -> bool:
        verdicts = {s.result.verdict.value for kinds in self.paths().values() for s in kinds.values()}
        return self.every_path_judged() and "leak" in verdicts


async def _serve(monitor: Monitor, settings: Settings, printer: PathPrinter, until_caught: bool,
                 duration: float | None) -> None:  # fmt: skip
    server = DemoServer(create_app(monitor), settings, STOP)

    async def narrate() -> None:
        deadline = None if duration is None else time.monotonic() + duration
        reported = False
        while not server.should_exit:
            await asyncio.sleep(0.5)
            if not reported and printer.caught():
                reported = True
                printer.report()
                print(f"  the monitor keeps running: http://{settings.api.listen}/api/v1/targets "
                      "(bearer token in the workdir's api-token); Ctrl-C to stop.\n", flush=True)  # fmt: skip
                server.should_exit = until_caught
            if STOP.asked or (deadline is not None and time.monotonic() >= deadline):
                server.should_exit = True

    task = asyncio.create_task(narrate())
    await server.serve()
    task.cancel()


def run_pd_demo(*, duration: float | None, port: int, workdir: Path | None, until_caught: bool) -> int:
    """Run the demo on the incident's topology; return 0 once a leaking pair was named with every
    path judged and the sound pairs passing."""
    python = router_python()
    if python is None:
        print("kvcanary demo --topology pd needs SGLang's gateway: bash scripts/setup-sglang-router.sh "
              "(or scripts/demo.sh --topology pd, which runs it)", flush=True)  # fmt: skip
        return 1
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvcanary-demo-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keys = {t: secrets.token_urlsafe(24) for t in TENANTS}
    for tenant, key in keys.items():
        (workdir / f"key-{tenant}").write_text(key)
        (workdir / f"key-{tenant}").chmod(0o600)
    worker_keys = workdir / "worker-keys"
    worker_keys.write_text("".join(f"{k}={t}\n" for t, k in keys.items()))
    worker_keys.chmod(0o600)
    (workdir / "api-token").write_text(secrets.token_urlsafe(32))
    (workdir / "api-token").chmod(0o600)
    print(f"kvcanary demo --topology pd — workdir {workdir}", flush=True)
    fleet = Fleet()
    STOP.children = fleet.procs  # the same list: what starts later is stopped too
    STOP.install()  # Ctrl-C and SIGTERM: the demo stops in order (stop.py)
    try:
        start_fleet(python, worker_keys, workdir, fleet)
        settings = pd_settings(workdir, fleet.gateway, port)
        upgrade(settings.database_url)
        printer = PathPrinter(fleet)
        monitor = Monitor.open(settings, on_summary=printer)
        print(f"  monitor http://127.0.0.1:{port}  target 'incident': base_url and sglang_router both the "
              f"gateway; probes {', '.join(KINDS)} every {INTERVAL:.0f}s\n", flush=True)  # fmt: skip
        asyncio.run(_serve(monitor, settings, printer, until_caught, duration))
        STOP.exit_if_terminated()
        sound = all(
            s.result.verdict.value == "pass"
            for path, kinds in printer.paths().items() if fleet.name_of(path).startswith("roomy")
            for s in kinds.values()
        )  # fmt: skip
        code = 0 if printer.caught() and sound else 1
        unmet = "" if code == 0 else "not all of: "
        print(f"=== demo: exit {code}: {unmet}a leaking pair named, every path judged, the sound pairs "
              "passing ===", flush=True)  # fmt: skip
        return code
    finally:
        stop_processes(fleet.procs)
