"""False-alarm soak: many probe runs against healthy targets with benign noise, zero leaks, zero mismatches.

    .venv/bin/python bench/soak.py [--runs 10000] [--targets 100] [--interval 2]

Starts the stub engine with ``--noise`` (a prefix before the answer, quotes, a few ms of jitter,
one 503 in fifty) and one `kvcanary serve` on SQLite probing every target with the default probe
set (canary, cross_tenant, boundary; boundary every 10 s here so it is exercised), waits until the
database holds ``--runs`` results, stops the monitor and counts verdicts from the database itself.
A healthy target must never yield a leak or a mismatch; errors (the 503s) are expected and are
not alarms. Exits 1 when any leak or mismatch was recorded.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from monitor_scale import REPO, TOKEN, free_port, pinned, wait_ok


def config(args: argparse.Namespace, stub: str, database: Path, port: int) -> dict:
    tenants = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    target = {"base_url": stub, "engine": "reference", "model": "m", "tenants": tenants,
              "probes": ["canary", "cross_tenant", "boundary"], "interval_seconds": args.interval,
              "probe_intervals": {"boundary": 10}}  # fmt: skip
    return {
        "database_url": f"sqlite:///{database}",
        "api": {"listen": f"127.0.0.1:{port}"},
        "targets": [{"name": f"soak{i:04d}", **target} for i in range(args.targets)],
    }


def counts(database: Path) -> dict[tuple[str, str], int]:
    with sqlite3.connect(database) as conn:
        rows = conn.execute("SELECT probe, verdict, count(*) FROM probe_result GROUP BY probe, verdict")
        return {(probe, verdict): n for probe, verdict, n in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--targets", type=int, default=100)
    parser.add_argument("--interval", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvcanary-soak-") as tmp_name:
        tmp = Path(tmp_name)
        stub_port, port, database = free_port(), free_port(), tmp / "soak.db"
        stub = subprocess.Popen([sys.executable, str(REPO / "bench" / "stub_engine.py"), str(stub_port),
                                 "--noise"], preexec_fn=pinned(1))  # fmt: skip
        path = tmp / "kvcanary.yml"
        path.write_text(yaml.safe_dump(config(args, f"http://127.0.0.1:{stub_port}", database, port)))
        env = {**os.environ, "KVCANARY_API_TOKEN": TOKEN, "KVCANARY_STATE_DIR": str(tmp / "state")}
        cli = [sys.executable, "-m", "monitor"]
        subprocess.run([*cli, "db", "upgrade", "--config", str(path)], check=True, cwd=REPO, env=env)
        with (tmp / "monitor.log").open("wb") as log:
            monitor = subprocess.Popen([*cli, "serve", "--config", str(path), "--log-level", "warning"],
                                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        started = time.monotonic()
        try:
            wait_ok(f"http://127.0.0.1:{port}/healthz", 120)
            while sum(counts(database).values()) < args.runs:
                time.sleep(2)
        finally:
            monitor.terminate()
            monitor.wait(60)
            stub.terminate()
            stub.wait(10)
        found = counts(database)
    took = time.monotonic() - started
    total = sum(found.values())
    for (probe, verdict), n in sorted(found.items()):
        print(f"{probe:>12} {verdict:>8} {n:>7}")
    alarms = sum(n for (_, verdict), n in found.items() if verdict in ("leak", "mismatch"))
    leaks = sum(n for (_, verdict), n in found.items() if verdict == "leak")
    print(f"soak: {total:,} runs in {took:.0f} s against {args.targets} noisy healthy targets: "
          f"{leaks} leak, {alarms - leaks} mismatch")  # fmt: skip
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
