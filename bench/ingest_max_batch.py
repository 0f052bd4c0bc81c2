"""A batch at the protocol's bounds through a real ``kvcanary serve``, in one run, side by side with
an older commit: what judging it costs, and what ``/healthz`` answers meanwhile.

For each tree (this working tree, and commit ``--against REV`` exported to a temporary folder), in
rounds whose order alternates (a machine shared with other work weighs on both alike), a fresh
``kvcanary serve`` of that tree on a PostgreSQL database of its own (``traffic.source: http``, one
deployment: the whole batch in one fingerprint window) is posted batches of ``--records`` records
(500: the review's scene; 1,000: the protocol's bound), each record with every print a side
allows (1,024 fingerprints and 256 distinctive tokens, random: nobody's), as the tap writes them.
For each post it reports

- ``post``: seconds until the answer, which comes once the batch is judged and stored, and the
  monitor's CPU seconds meanwhile (every thread of it, from ``/proc``);
- ``/healthz``: p50, p99 and max of its answer time, asked every ``--health-every`` seconds (0.02)
  from the post to its answer (a tree that answers 413 to a batch says so, and has no figures for
  it). Each ``/healthz`` costs the monitor CPU and turns of its loop: asked less often, the post's
  time is the judge's more nearly.

``--stream`` adds the same through the traffic stream (``traffic.source: jetstream``, the machine's
NATS or ``--nats URL``, one replica holding the 16 partitions, the records over 24 deployments):
seconds from the post until every record is judged, ``/healthz`` meanwhile, and whether the replica
lost or moved a partition (its ``/healthz`` read throughout, and its log).

    .venv/bin/python bench/ingest_max_batch.py --against REV [--records 500,1000] [--rounds 3] [--stream]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402  (run as a script from the repository)
import yaml  # noqa: E402

from bench.jetstream_rig import Database, cpu_seconds, percentile, until  # noqa: E402
from kvcanary.wire import VERSION  # noqa: E402
from tests.support import free_port, stop_process  # noqa: E402
from tests.support.jetstream import delete_created, new_names, replica_config  # noqa: E402

TOKEN = "bench-token-0123456789abcdef"
BASE = "http://10.7.0.1:8000/v1"
STREAM_BASES = [f"http://10.7.1.{i}:8000/v1" for i in range(1, 25)]
FINGERPRINTS, TOKENS = 1024, 256  # a side: the protocol's bounds (docs/tap-protocol.md)


def largest_batch(records: int, bases: list[str], seed: int) -> bytes:
    """A batch of ``records`` records of eight callers over ``bases``, each with every print a side
    allows, random, written as the tap writes it (compact JSON)."""
    rng = random.Random(seed)

    def prints(n: int) -> list[int]:
        return [rng.getrandbits(51) | 1 for _ in range(n)]

    made = [
        {"id": f"tap-{seed:08x}{i:016x}", "time": time.time(), "caller": f"team-{i % 8}",
         "caller_kind": "team", "api_base": bases[i % len(bases)], "status": 200,
         "prompt": {"chars": 9000, "bytes": 9000, "messages": 2},
         "fingerprints": {"prompt": prints(FINGERPRINTS), "response": prints(FINGERPRINTS)},
         "distinctive": {"prompt": prints(TOKENS), "response": prints(TOKENS)}}
        for i in range(records)
    ]  # fmt: skip
    return json.dumps(
        {"version": VERSION, "batch": uuid.uuid4().hex, "gateway": "bench", "records": made},
        separators=(",", ":"),
    ).encode()


class Served:
    """``kvcanary serve`` of ``tree`` as a process, in a folder of its own, on ``database``."""

    def __init__(self, tree: Path, folder: Path, config: dict[str, Any]):
        folder.mkdir(parents=True)
        self.tree, self.port = tree, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            **config,
            "spool": {"path": str(folder / "spool")},
            "api": {"listen": f"127.0.0.1:{self.port}"},
        }
        self.config = folder / "kvcanary.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.log = folder / "monitor.log"
        self.env = {**os.environ, "KVCANARY_API_TOKEN": TOKEN, "KVCANARY_STATE_DIR": str(folder / "state")}
        command = [sys.executable, "-m", "monitor"]  # run in the tree: its own kvcanary is imported
        subprocess.run([*command, "db", "upgrade", "--config", str(self.config)], cwd=tree, env=self.env,
                       check=True, capture_output=True, timeout=180)  # fmt: skip
        serve = [*command, "serve", "--config", str(self.config)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(serve, cwd=tree, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        until("kvcanary serve to answer /healthz", self.answers, 120, 0.25)

    def answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvcanary serve exited: {self.log.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/healthz", timeout=5).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    def stream(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/healthz", timeout=30).json().get("traffic_stream", {}))

    def post(self, body: bytes) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        return httpx.post(self.url + "/api/v1/traffic", content=body, headers=headers, timeout=600)

    def stop(self) -> None:
        stop_process(self.proc, timeout=30)


class Health(threading.Thread):
    """Asks a monitor's ``/healthz`` every ``every`` seconds until stopped: each answer's time, and
    each change of the partitions it holds from those it held at the start."""

    def __init__(self, monitor: Served, every: float):
        super().__init__(daemon=True)
        self.monitor, self.every = monitor, every
        self.held = monitor.stream().get("partitions")
        self.seconds: list[float] = []
        self.moved = 0
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.done.is_set():
                began = time.perf_counter()
                answer = client.get(self.monitor.url + "/healthz")
                self.seconds.append(time.perf_counter() - began)
                self.moved += answer.json().get("traffic_stream", {}).get("partitions") != self.held
                self.done.wait(self.every)

    def figures(self) -> dict[str, float]:
        return {"p50": percentile(self.seconds, 0.5), "p99": percentile(self.seconds, 0.99),
                "max": max(self.seconds), "n": len(self.seconds)}  # fmt: skip


def measured(monitor: Served, act: Callable[[], int], every: float) -> dict[str, Any]:
    """Run ``act`` (the post: its status) beside a :class:`Health`; return its time, the monitor's
    CPU seconds meanwhile, and ``/healthz``'s figures."""
    health = Health(monitor, every)
    health.start()
    time.sleep(0.2)
    cpu, began = cpu_seconds(monitor.proc.pid), time.perf_counter()
    status = act()
    took, cpu = time.perf_counter() - began, cpu_seconds(monitor.proc.pid) - cpu
    health.done.set()
    health.join()
    return {"status": status, "seconds": took, "cpu": cpu, "moved": health.moved, **health.figures()}


def over_http(
    tree: Path, folder: Path, pg: tuple[str, int], bodies: dict[int, bytes], every: float
) -> dict[int, dict[str, Any]]:
    """Post each body to a fresh serve of ``tree``; return the figures by record count."""
    database = Database(*pg)
    target = {"name": "t", "base_url": f"http://127.0.0.1:{free_port()}/v1", "engine": "reference",
              "model": "m", "tenants": [{"name": "a"}, {"name": "b"}], "probes": ["canary"],
              "interval_seconds": 3600, "gateway_api_bases": [BASE]}  # fmt: skip
    monitor = Served(tree, folder, {"database_url": database.url, "targets": [target]})
    try:
        return {
            records: measured(monitor, lambda body=body: monitor.post(body).status_code, every)
            for records, body in bodies.items()
        }
    finally:
        monitor.stop()
        database.drop()


def over_stream(
    tree: Path, folder: Path, pg: tuple[str, int], nats_url: str, body: bytes, records: int, every: float
) -> dict[str, Any]:
    """Post ``body`` to a fresh serve of ``tree`` consuming the stream; return the figures."""
    database, names = Database(*pg), new_names()
    config = replica_config(database.url, names, STREAM_BASES, nats_url, max_bytes=256 * 2**20)
    monitor = Served(tree, folder, config)
    try:
        until(
            "the replica to hold every partition",
            lambda: len(monitor.stream().get("partitions", [])) == 16,
            60,
        )

        def act() -> int:
            status = monitor.post(body).status_code
            if status == 200:
                until("every record judged", lambda: database.judged("tap-") >= records, 600, 0.05)
            return status

        figures = measured(monitor, act, every)
        figures["lapsed"] = monitor.log.read_text(errors="replace").count("lapsed")
        return figures
    finally:
        monitor.stop()
        database.drop()
        delete_created(names, nats_url)


def export(rev: str, into: Path) -> Path:
    exported = into / "rev"
    exported.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(exported)], input=archive.stdout, check=True)
    return exported


def line(name: str, what: str, f: dict[str, Any]) -> str:
    if f["status"] != 200:
        return f"  {name:>12} {what}: answered {f['status']}"
    extra = f", partitions moved in {f['moved']} reads, lapsed {f['lapsed']}" if "lapsed" in f else ""
    healthz = f"p50 {f['p50'] * 1e3:.0f} ms, p99 {f['p99'] * 1e3:.0f} ms, max {f['max'] * 1e3:.0f} ms"
    took = f"{f['seconds']:.2f} s ({f['cpu']:.2f} CPU-s)"
    return f"  {name:>12} {what}: {took}; /healthz {healthz} ({f['n']:.0f} asked){extra}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", metavar="REV", help="an older commit, measured in turns with this tree")
    parser.add_argument("--records", default="500,1000", help="records a batch, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream", action="store_true", help="also through the traffic stream")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--health-every", type=float, default=0.02, help="seconds between /healthz asks")
    parser.add_argument("--pg-host", default="127.0.0.1")
    parser.add_argument("--pg-port", type=int, default=5432)
    args = parser.parse_args()
    sizes = [int(n) for n in args.records.split(",")]
    pg = (args.pg_host, args.pg_port)
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-") as tmp:
        trees = {"working tree": REPO}
        if args.against:
            trees = {args.against: export(args.against, Path(tmp)), **trees}
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for n in range(args.rounds):
            bodies = {records: largest_batch(records, [BASE], n) for records in sizes}
            stream_body = largest_batch(max(sizes), STREAM_BASES, 100 + n) if args.stream else b""
            print(
                f"round {n + 1}: bodies of "
                + ", ".join(f"{r} records {len(b) / 2**20:.1f} MiB" for r, b in bodies.items()),
                flush=True,
            )
            for name in list(trees) if n % 2 == 0 else list(trees)[::-1]:
                folder = Path(tmp) / f"{n}-{len(results)}-{uuid.uuid4().hex[:6]}"
                folder.mkdir()
                for records, f in over_http(
                    trees[name], folder / "http", pg, bodies, args.health_every
                ).items():
                    results.setdefault((name, f"{records} records over HTTP"), []).append(f)
                    print(line(name, f"{records} records over HTTP", f), flush=True)
                if args.stream:
                    f = over_stream(
                        trees[name],
                        folder / "stream",
                        pg,
                        args.nats,
                        stream_body,
                        max(sizes),
                        args.health_every,
                    )
                    results.setdefault((name, f"{max(sizes)} records through the stream"), []).append(f)
                    print(line(name, f"{max(sizes)} records through the stream", f), flush=True)
        print("medians of the rounds:")
        for (name, what), runs in results.items():
            taken = [f for f in runs if f["status"] == 200]
            if not taken:
                print(f"  {name:>12} {what}: answered {runs[0]['status']} in every round")
                continue
            figures = ("seconds", "cpu", "p50", "p99", "max", "n")
            median = {"status": 200, **{k: statistics.median(f[k] for f in taken) for k in figures}}
            if "lapsed" in taken[0]:
                median |= {"moved": sum(f["moved"] for f in taken), "lapsed": sum(f["lapsed"] for f in taken)}
            print(line(name, what, median) + f" [{len(taken)} of {len(runs)} rounds]")


if __name__ == "__main__":
    main()
