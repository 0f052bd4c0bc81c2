"""REST list latency on a large PostgreSQL database: p50/p99 of every list endpoint and filter.

Creates a throw-away database on 127.0.0.1:5432, migrates it to the revision before the list
indexes, fills it by COPY with ``--rows`` probe results (50 targets x 3 probes over 90 days, 1% of
them leak, mismatch or error, with the incidents those open and resolve), migrates it to the head
(timing the index build), VACUUM ANALYZE, then serves the real app (``monitor.http_app.create_app``,
scheduler off) with uvicorn on loopback in its own process and sends each query ``--requests``
times in a row with httpx, after a few unmeasured warm-up requests. Parameters rotate (targets,
days, incidents) so that a query does not hit one cached page. The database is dropped at the end
(``--keep`` keeps it; ``--database NAME`` measures an existing one without filling it).

The fill turns off foreign-key triggers (``session_replication_role = replica``: superuser) because
the generator writes results before the incidents they link to.

Usage: ``.venv/bin/python bench/rest_scale.py [--rows 10000000] [--requests 200] [--keep]``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcanary.monitor.api.deps import TimeRange, cursor_scope, encode_cursor
from kvcanary.monitor.storage.db import upgrade
from kvcanary.monitor.storage.queries import Key
from kvcanary.processes import free_port, wait_until

PG = "host=127.0.0.1 port=5432 user=postgres"
#: The revision before the list indexes: the table is filled there and the indexes built after.
FILL_AT = "8b1e4c7d2a90"
TARGETS = [f"t{i:02d}" for i in range(50)]
PROBES = ("cross_tenant", "canary", "capacity")
END = datetime(2026, 11, 30, tzinfo=UTC)
SPAN_US = 90 * 86_400 * 1_000_000
START_US = int((END - timedelta(days=90)).timestamp() * 1_000_000)
GOAL_MS = 50.0
WARMUP = 5
FAIL = {"leak": ("foreign_marker", "critical"), "mismatch": ("wrong_answer", "high")}
OPENED_BY, NULL = {"critical": "leak", "high": "mismatch"}, "\\N"  # NULL: in COPY text format
Pair = tuple[int, str, str]  # target id, probe, node
Book = dict[Pair, list[Any]]  # the open incident of each pair, as a mutable row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="probe_result rows (default: %(default)s)")
    p.add_argument("--requests", type=int, default=200, help="measured requests per query (%(default)s)")
    p.add_argument("--seed", type=int, default=7, help="random seed (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    p.add_argument("--database", help="measure this existing, filled database instead of filling one")
    return p.parse_args(argv)


# --- the fill ----------------------------------------------------------------------------------------


class Timestamps:
    """Format epoch microseconds as PostgreSQL text fast: rows come in time order, so the
    formatted second is reused."""

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def __call__(self, micros: int) -> str:
        second, fraction = divmod(micros, 1_000_000)
        if second != self._second:
            self._second, self._text = second, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(second))
        return f"{self._text}.{fraction:06d}+00"


def result_lines(rows: int, seed: int, incidents: list[tuple[Any, ...]]) -> Iterator[str]:
    """Yield ``rows`` probe_result COPY lines in time order; append the incidents they open."""
    rng = random.Random(seed)
    started, expires = Timestamps(), Timestamps()
    book: Book = {}
    for i in range(rows):
        at = START_US + SPAN_US * i // rows
        target_id, probe = rng.randrange(len(TARGETS)) + 1, PROBES[rng.randrange(3)]
        node = ("prefill-0", "decode-0")[rng.randrange(2)] if probe == "capacity" else ""
        roll = rng.random()
        verdict = "pass" if roll >= 0.01 else ("leak", "mismatch", "error")[int(roll * 300)]
        incident = _judge(book, incidents, (target_id, probe, node), verdict, at, i + 1)
        reason = FAIL[verdict][0] if verdict in FAIL else ("ok" if verdict == "pass" else "timeout")
        keep_us = (7 if verdict == "pass" else 90) * 86_400_000_000
        evidence = '{"marker_ids": ["m-1"]}' if verdict == "leak" else "{}"
        yield (
            f"{i + 1}\t{target_id}\t{probe}\t{node}\t{verdict}\t{reason}\t{verdict} seen\t{started(at)}\t"
            f"0.5\t200\t0.4\t0.1\t512\t512\t{evidence}\t{incident or NULL}\t{expires(at + keep_us)}\n"
        )
    incidents.extend(tuple(record) for record in book.values())


def _judge(
    book: Book, closed: list[tuple[Any, ...]], pair: Pair, verdict: str, at: int, rid: int
) -> int | None:
    """Open, count or resolve the pair's incident as monitor.incidents would; return its id."""
    record = book.get(pair)
    if record is None and verdict in FAIL:
        incident_id = len(closed) + len(book) + 1
        # id, target, probe, node, severity, state, opened, last failure, resolved, failures, passes,
        # last verdict, the result that opened it
        record = [incident_id, *pair, FAIL[verdict][1], "open", at, at, None, 1, 0, verdict, rid]
        book[pair] = record
        return incident_id
    if record is None:
        return None
    if verdict in FAIL:
        record[7], record[9], record[10], record[11] = at, record[9] + 1, 0, verdict
    elif verdict == "pass":
        record[10] += 1
        if record[10] >= 3:
            record[5], record[8] = "resolved", at
            closed.append(tuple(book.pop(pair)))
    return int(record[0])


def incident_lines(incidents: list[tuple[Any, ...]]) -> tuple[list[str], list[str]]:
    """Return the COPY lines of the incidents and of their events (opened, and resolved)."""
    ts = Timestamps()
    rows, events = [], []
    for n, record in enumerate(sorted(incidents)):
        iid, target_id, probe, node, sev, state, opened, last, resolved, fails, passes, last_v, rid = record
        resolved_text = ts(resolved) if resolved is not None else NULL
        rows.append(
            f"{iid}\t{target_id}\t{probe}\t{node}\t{sev}\t{state}\t{last_v} on t{target_id - 1:02d}/{probe}\t"
            f"{ts(opened)}\t{ts(last)}\t{resolved_text}\t{fails}\t{passes}\t{last_v}\t{FAIL[last_v][0]}\n"
        )
        events.append(
            f"{2 * n + 1}\t{iid}\t{ts(opened)}\topened\t\\N\topen\t\\N\t{sev}\t{OPENED_BY[sev]}\t{rid}\t0\n"
        )
        if resolved is not None:
            events.append(
                f"{2 * n + 2}\t{iid}\t{resolved_text}\tresolved\topen\tresolved\t{sev}\t{sev}\t\\N\t\\N\t0\n"
            )
    return rows, events


RESULT_COLUMNS = (
    "id, target_id, probe, node, verdict, reason, detail, started_at, duration_seconds, status_code, "
    "latency_seconds, ttft_seconds, prompt_tokens_sent, prompt_tokens_reported, evidence, incident_id, "
    "expires_at"
)
INCIDENT_COLUMNS = (
    "id, target_id, probe, node, severity, state, title, opened_at, last_failure_at, resolved_at, "
    "failure_count, consecutive_passes, last_verdict, last_reason"
)
EVENT_COLUMNS = (
    "id, incident_id, created_at, kind, old_state, new_state, old_severity, new_severity, verdict, "
    "probe_result_id, attempts"
)


def fill(dsn: str, rows: int, seed: int) -> int:
    """Fill targets, probe results, incidents and their events by COPY; return the incident count."""
    incidents: list[tuple[Any, ...]] = []
    with psycopg.connect(dsn) as conn:
        conn.execute("SET session_replication_role = replica")  # the generator keeps references whole
        at = "2026-09-01 00:00:00+00"
        targets = (
            f"{i}\t{n}\tsglang\thttp://10.0.0.{i}:30000\tm\t{at}\t{at}\n" for i, n in enumerate(TARGETS, 1)
        )
        _copy(
            conn,
            "COPY target (id, name, engine, base_url, model, created_at, updated_at) FROM STDIN",
            targets,
        )
        _copy(conn, f"COPY probe_result ({RESULT_COLUMNS}) FROM STDIN", result_lines(rows, seed, incidents))
        incident_rows, event_rows = incident_lines(incidents)
        _copy(conn, f"COPY incident ({INCIDENT_COLUMNS}) FROM STDIN", iter(incident_rows))
        _copy(conn, f"COPY incident_event ({EVENT_COLUMNS}) FROM STDIN", iter(event_rows))
        for table in ("target", "probe_result", "incident", "incident_event"):
            sequence = f"pg_get_serial_sequence('{table}', 'id')"
            conn.execute(f"SELECT setval({sequence}, (SELECT max(id) FROM {table}))")
    return len(incidents)


def _copy(conn: psycopg.Connection[Any], statement: str, lines: Iterator[str]) -> None:
    with conn.cursor().copy(statement) as copy:
        chunk: list[str] = []
        for line in lines:
            chunk.append(line)
            if len(chunk) == 20_000:
                copy.write("".join(chunk))
                chunk.clear()
        copy.write("".join(chunk))


# --- the server --------------------------------------------------------------------------------------


def serve(url: str, port: int, token: str) -> None:
    """Run the real app on 127.0.0.1:``port`` with the scheduler off (in a child process)."""
    import uvicorn

    from kvcanary.monitor.app import Monitor
    from kvcanary.monitor.config.settings import Settings
    from kvcanary.monitor.http_app import create_app

    os.environ["KVCANARY_API_TOKEN"] = token
    tenants = [{"name": "alice"}, {"name": "bob"}]
    targets = [
        dict(name=name, base_url=f"http://10.0.0.{i}:30000", model="glm-5.3", tenants=tenants, probes=PROBES)
        for i, name in enumerate(TARGETS, 1)
    ]
    settings = Settings.model_validate(
        {"database_url": url, "spool": {"in_memory": True}, "targets": targets}
    )
    app = create_app(Monitor.open(settings), start_scheduler=False)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- the measurement ---------------------------------------------------------------------------------

Params = Callable[[int], dict[str, Any]]


def queries(rng: random.Random, incident_ids: list[int]) -> list[tuple[str, str, Params]]:
    """Return (label, path, params of the i-th request) for every query measured."""
    target = lambda i: TARGETS[(i * 7) % len(TARGETS)]  # noqa: E731
    day = lambda i: END - timedelta(days=1 + rng.random() * 88)  # noqa: E731
    by_pair = lambda i: {"target": target(i), "probe": PROBES[i % 3]}  # noqa: E731
    results, incidents = "/api/v1/probe-results", "/api/v1/incidents"
    return [
        ("results, unfiltered", results, lambda i: {}),
        ("results, verdict=leak", results, lambda i: {"verdict": "leak"}),
        ("results, target", results, lambda i: {"target": target(i)}),
        ("results, target+probe", results, by_pair),
        ("results, target+verdict=leak", results, lambda i: {"target": target(i), "verdict": "leak"}),
        ("results, target+probe+verdict=leak", results, lambda i: {**by_pair(i), "verdict": "leak"}),
        ("results, 1-day range", results, lambda i: _day(day(i))),
        ("results, probe=canary (no index leads)", results, lambda i: {"probe": "canary"}),
        ("results, node=prefill-0 (no index leads)", results, lambda i: {"node": "prefill-0"}),
        ("results, node absent (reads the whole scan budget)", results, lambda i: {"node": "absent-0"}),
        ("results, limit=500", results, lambda i: {"limit": 500}),
        ("results, offset=10000 (the cap)", results, lambda i: {"offset": 10_000}),
        ("incidents, unfiltered", incidents, lambda i: {}),
        ("incidents, state=open", incidents, lambda i: {"state": "open"}),
        ("incidents, target+state=open", incidents, lambda i: {"target": target(i), "state": "open"}),
        ("incidents, target", incidents, lambda i: {"target": target(i)}),
        ("incidents, severity=high (no index leads)", incidents, lambda i: {"severity": "high"}),
        ("incident detail", incidents, lambda i: {"_path": f"/{incident_ids[i % len(incident_ids)]}"}),
        ("targets (last verdicts of 150 pairs)", "/api/v1/targets", lambda i: {}),
    ]


def _day(start: datetime) -> dict[str, Any]:
    return {"since": start.isoformat(), "until": (start + timedelta(days=1)).isoformat()}


def timed(client: httpx.Client, path: str, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Return the seconds one GET took and its JSON body; raise on any status but 200."""
    path += params.pop("_path", "")
    began = time.perf_counter()
    response = client.get(path, params=params)
    elapsed = time.perf_counter() - began
    response.raise_for_status()
    return elapsed, response.json()


def measure(client: httpx.Client, path: str, params: Params, n: int) -> tuple[list[float], float]:
    """Return the seconds of ``n`` requests (after WARMUP more) and the mean items per page."""
    for i in range(WARMUP):
        timed(client, path, params(n + i))
    times, items = [], 0
    for i in range(n):
        elapsed, body = timed(client, path, params(i))
        times.append(elapsed)
        items += len(body.get("items", body.get("results", [])))
    return times, items / n


def follow_cursor(client: httpx.Client, start: str, n: int) -> tuple[list[float], float]:
    """Return the seconds of ``n`` pages read by following next_cursor from ``start``."""
    times, items, cursor = [], 0, start
    for _ in range(n + WARMUP):
        elapsed, body = timed(client, "/api/v1/probe-results", {"cursor": cursor})
        times.append(elapsed)
        items += len(body["items"])
        cursor = body["next_cursor"]
    return times[WARMUP:], items / (n + WARMUP)


def row(label: str, times: list[float], items: float) -> str:
    p50 = statistics.median(times) * 1000
    p99 = statistics.quantiles(times, n=100, method="inclusive")[98] * 1000
    ok = "yes" if p99 <= GOAL_MS else "**no**"
    return f"| {label} | {p50:.1f} | {p99:.1f} | {items:.0f} | {ok} |"


def run_queries(base: str, token: str, dsn: str, n: int, seed: int) -> None:
    """Print the table of p50/p99 per query against the server at ``base``."""
    rng = random.Random(seed)
    with psycopg.connect(dsn) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM incident ORDER BY random() LIMIT 500")]
        total = conn.execute("SELECT count(*) FROM probe_result").fetchone()[0]  # type: ignore[index]
        server_version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        middle = "SELECT started_at, id FROM probe_result WHERE id >= (SELECT max(id) / 2 FROM probe_result)"
        mid = conn.execute(middle + " ORDER BY id LIMIT 1").fetchone()
    assert mid is not None and ids, "the database is empty"
    # What a client deep in the list holds: the cursor of the middle row.
    deep = encode_cursor(Key(mid[0], mid[1]), cursor_scope("probe-results", TimeRange(None, None)))
    assert deep is not None
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nPostgreSQL {server_version}, {total:,} probe_result rows; uvicorn + httpx on loopback;")
    print(f"{os.cpu_count()} CPUs, load average {load}; {WARMUP} warm-up requests per query not counted\n")
    print(f"| query ({n} sequential requests each) | p50 ms | p99 ms | items/page | p99 ≤ {GOAL_MS:.0f} ms |")
    print("|---|---:|---:|---:|:---:|")
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        for label, path, params in queries(rng, ids):
            print(row(label, *measure(client, path, params, n)), flush=True)
        print(row("results, next_cursor pages from the middle", *follow_cursor(client, deep, n)), flush=True)


# --- main --------------------------------------------------------------------------------------------


def prepare(dsn: str, url: str, rows: int, seed: int) -> None:
    """Migrate to FILL_AT, fill, migrate to the head, VACUUM ANALYZE; print how long each took."""
    upgrade(url, FILL_AT)
    began = time.perf_counter()
    n_incidents = fill(dsn, rows, seed)
    print(f"filled {rows:,} probe results, {n_incidents:,} incidents: {time.perf_counter() - began:.0f} s")
    began = time.perf_counter()
    upgrade(url)
    print(f"migration to head (the list indexes) on that table: {time.perf_counter() - began:.0f} s")
    began = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('probe_result'))").fetchone()
    print(
        f"VACUUM ANALYZE: {time.perf_counter() - began:.0f} s; probe_result and indexes: {size and size[0]}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.database or f"kvcanary_bench_{uuid.uuid4().hex[:8]}"
    dsn, url = f"{PG} dbname={name}", f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    admin = f"{PG} dbname=postgres"
    if not args.database:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    token, port = secrets.token_hex(16), free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(url, port, token), daemon=True)
    try:
        if not args.database:
            prepare(dsn, url, args.rows, args.seed)
        server.start()
        _wait_ready(f"http://127.0.0.1:{port}/healthz", server)
        run_queries(f"http://127.0.0.1:{port}", token, dsn, args.requests, args.seed)
    finally:
        if server.is_alive():
            server.terminate()
            server.join(10)
        if args.keep or args.database:
            print(f"kept database {name}")
        else:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


def _wait_ready(url: str, server: multiprocessing.process.BaseProcess) -> None:
    def answers() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url, timeout=1).status_code == 200
        return False

    def exited() -> str | None:
        return None if server.is_alive() else f"the server exited with {server.exitcode}"

    wait_until(f"{url} to answer", answers, 60, every=0.2, alive=exited)


if __name__ == "__main__":
    sys.exit(main())
