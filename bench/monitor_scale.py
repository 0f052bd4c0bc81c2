"""How far one `kvcanary serve` process goes on one core, and three replicas on PostgreSQL.

    .venv/bin/python bench/monitor_scale.py [--targets 500,2000,5000] [--probes canary|default]
                                            [--interval 30] [--warmup 90] [--measure 60] [--replicas 1]
                                            [--database sqlite|postgresql]

For each size it starts the fast stub engine (bench/stub_engine.py) pinned to one core and the
monitor pinned to another, every target pointing at the stub, waits ``--warmup`` seconds (every
first run is spread over one interval, and first runs cost more), then measures for
``--measure`` seconds: monitor CPU per probe run (process CPU time over runs completed, robust
to noise), runs/s achieved against scheduled, schedule lag p50/p99
(``kvcanary_schedule_lag_seconds``), RSS per target, start-up time, and the size and time of a
``/metrics`` scrape. Replicas share the monitor's core (this machine has two). The last lines
are a Markdown table for docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from kvcanary.monitor.config.settings import parse_settings  # noqa: E402  (run as a script from the repository)
from kvcanary.processes import free_port  # noqa: E402

TOKEN = "bench-token-0123456789abcdef"
PROBE_SETS = {"canary": ["canary"], "default": ["canary", "cross_tenant", "boundary"]}


def pinned(core: int) -> object:
    cores = os.sched_getaffinity(0)
    chosen = {sorted(cores)[core % len(cores)]}
    return lambda: os.sched_setaffinity(0, chosen)


def wait_ok(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def samples(url: str) -> tuple[dict[str, float], dict[float, float], int, float]:
    """Return (sums by name, lag histogram buckets, page bytes, scrape seconds)."""
    started = time.perf_counter()
    text = httpx.get(url + "/metrics", timeout=60).text
    took = time.perf_counter() - started
    sums: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
            if s.name == "kvcanary_schedule_lag_seconds_bucket":
                buckets[float(s.labels["le"])] = s.value
    return sums, buckets, len(text.encode()), took


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """Estimate a quantile from two cumulative histograms (Prometheus's histogram_quantile)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return float("nan")
    rank, lower, seen = q * total, 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - seen) / max(cum - seen, 1e-9)
        lower, seen = bound, cum
    return bounds[-2]


@dataclass
class Row:
    targets: int
    replicas: int
    cpu_ms_per_run: float
    runs_per_s: float
    scheduled_per_s: float
    lag_p50: float
    lag_p99: float
    rss_kb_per_target: float
    startup_s: float
    metrics_kb: float
    metrics_s: float
    busiest_share: float  # the largest share of the runs one replica did (1/replicas when even)


def config(targets: int, probes: list[str], interval: float, stub: str, database_url: str, port: int) -> dict:
    tenants = [{"name": "a"}, {"name": "b"}]
    return {
        "database_url": database_url,
        "api": {"listen": f"127.0.0.1:{port}"},
        "scheduler": {"max_concurrency": 64},
        "spool": {"in_memory": True},
        "targets": [
            {"name": f"t{i:05d}", "base_url": stub, "engine": "reference", "model": "m", "tenants": tenants,
             "probes": probes, "interval_seconds": interval}
            for i in range(targets)
        ],
    }  # fmt: skip


def database(kind: str, tmp: Path) -> tuple[str, object]:
    if kind == "sqlite":
        return f"sqlite:///{tmp / 'bench.db'}", lambda: None
    import psycopg

    name = f"kvcanary_bench_{uuid.uuid4().hex[:8]}"
    admin = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}", drop


def run_size(args: argparse.Namespace, targets: int, tmp: Path) -> Row:
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, str(REPO / "bench" / "stub_engine.py"), str(stub_port)],
                            preexec_fn=pinned(1))  # fmt: skip
    url_db, drop = database(args.database, tmp)
    monitors: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        env = {**os.environ, "KVCANARY_API_TOKEN": TOKEN, "KVCANARY_STATE_DIR": str(tmp / "state")}
        probes = PROBE_SETS[args.probes]
        started = time.monotonic()
        for i in range(args.replicas):
            port = free_port()
            path = tmp / f"kvcanary-{targets}-{i}.yml"
            path.write_text(yaml.safe_dump(config(targets, probes, args.interval, f"http://127.0.0.1:{stub_port}",
                                                  url_db, port)))  # fmt: skip
            if i == 0:
                subprocess.run([sys.executable, "-m", "monitor", "db", "upgrade", "--config", str(path)],
                               check=True, cwd=REPO, env=env, capture_output=True)  # fmt: skip
            log = (tmp / f"monitor-{targets}-{i}.log").open("wb")
            proc = subprocess.Popen([sys.executable, "-m", "monitor", "serve", "--config", str(path),
                                     "--log-level", "warning"], cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, preexec_fn=pinned(0))  # fmt: skip
            monitors.append((f"http://127.0.0.1:{port}", proc))
        for url, _ in monitors:
            wait_ok(url + "/healthz", 600)
        startup = time.monotonic() - started
        # Every first run is spread over one interval, and first runs cost more (state and
        # capacity lookups, token counts): measure the steady state after they settle.
        time.sleep(args.warmup)
        before = [(samples(url), cpu_seconds(p.pid)) for url, p in monitors]
        time.sleep(args.measure)
        after = [(samples(url), cpu_seconds(p.pid)) for url, p in monitors]
        return summarise(args, targets, monitors, before, after, startup)
    finally:
        for _, proc in monitors:
            proc.terminate()
            proc.wait(60)
        stub.terminate()
        stub.wait(10)
        drop()  # type: ignore[operator]


def summarise(
    args: argparse.Namespace, targets: int, monitors: list, before: list, after: list, startup: float
) -> Row:
    each = [a[0][0].get("kvcanary_probe_runs_total", 0) - b[0][0].get("kvcanary_probe_runs_total", 0)
            for a, b in zip(after, before, strict=True)]  # fmt: skip
    runs = sum(each)
    cpu = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    lag_before, lag_after = before[0][0][1], after[0][0][1]
    # The intervals the monitor itself gives each kind (boundary has a longer default).
    one = parse_settings(config(1, PROBE_SETS[args.probes], args.interval, "http://stub", "sqlite://", 1))
    scheduled = targets * sum(1 / one.targets[0].interval_for(p) for p in one.targets[0].probes)
    rss = sum(rss_mb(p.pid) for _, p in monitors)
    return Row(
        targets=targets, replicas=args.replicas, cpu_ms_per_run=1000 * cpu / max(runs, 1),
        runs_per_s=runs / args.measure, scheduled_per_s=scheduled,
        lag_p50=quantile(0.5, lag_before, lag_after), lag_p99=quantile(0.99, lag_before, lag_after),
        rss_kb_per_target=1024 * rss / targets, startup_s=startup,
        metrics_kb=after[0][0][2] / 1024, metrics_s=after[0][0][3], busiest_share=max(each) / max(runs, 1),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="500,2000,5000")
    parser.add_argument("--probes", choices=sorted(PROBE_SETS), default="canary")
    parser.add_argument("--interval", type=float, default=30.0)
    parser.add_argument("--measure", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=90.0, help="seconds between start-up and measuring")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    args = parser.parse_args()
    if args.replicas > 1 and args.database != "postgresql":
        parser.error("--replicas > 1 needs --database postgresql")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-") as tmp:
        for n in (int(x) for x in args.targets.split(",")):
            row = run_size(args, n, Path(tmp))
            print(row, flush=True)
            rows.append(row)
    print(f"\nprobes={args.probes} interval={args.interval:g}s replicas={args.replicas} db={args.database} "
          f"cores={len(os.sched_getaffinity(0))} load={os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| targets | replicas | CPU ms/run | runs/s (scheduled) | lag p50 / p99 s | RSS KB/target "
          "| start-up s | /metrics KB, s | busiest replica's share |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r.runs_per_s:.0f} ({r.scheduled_per_s:.0f})"
        lag = f"{r.lag_p50:.2f} / {r.lag_p99:.2f}"
        scrape = f"{r.metrics_kb:.0f}, {r.metrics_s:.2f}"
        print(
            f"| {r.targets:,} | {r.replicas} | {r.cpu_ms_per_run:.2f} | {rate} | {lag} | "
            f"{r.rss_kb_per_target:.0f} | {r.startup_s:.1f} | {scrape} | {r.busiest_share:.0%} |"
        )


if __name__ == "__main__":
    main()
