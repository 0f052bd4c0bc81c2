"""Blast radius figures, in one run on this machine:

- ``postgres``: an incident's blast radius over 10 M kept traffic rows in PostgreSQL (8 targets,
  30 days, the incident's target holding 1.25 M of them, its window 13 days as the incident's
  was), p50 and p99 of repeated computations through ``monitor.blast.compute.blast_radius``; and
  an at-risk one over the per-minute counts. Goal: p99 <= 2 s.
- ``logs``: LiteLLM logging payloads as JSON lines (and the same as Parquet) scanned by DuckDB on
  one thread (``threads=1``): megabytes of log per second. Goal: >= 100 MB/s on one core.

    .venv/bin/python bench/blast_radius.py [--rows 10000000] [--log-mb 300] [--repeat 20]

PostgreSQL is the machine's (127.0.0.1:5432); the bench makes its own database and drops it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import duckdb
import psycopg

from kvcanary.monitor.blast.compute import BlastSources, blast_radius
from kvcanary.monitor.blast.logs import logs_tally
from kvcanary.monitor.blast.question import Bound, Criterion, Scope, Window
from kvcanary.monitor.config.settings import IncidentConfig, RetentionConfig, Settings
from kvcanary.monitor.incidents import record_result
from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.probes.base import ProbeResult, Verdict

PG = os.environ.get("KVCANARY_BENCH_PG", "host=127.0.0.1 port=5432 user=postgres")
TARGETS = 8
NOW = datetime.now(UTC).replace(microsecond=0)
POOL = 1024


def settings() -> Settings:
    targets = [
        {
            "name": f"t{i}",
            "base_url": f"http://10.0.0.{i}:8000/v1",
            "engine": "reference",
            "model": "m",
            "tenants": [{"name": "alice"}, {"name": "bob"}],
        }
        for i in range(1, TARGETS + 1)
    ]
    return Settings.model_validate({"targets": targets})


def fill_rows(url: str, rows: int) -> None:
    """``rows`` kept records over 30 days, spread over the targets, inserted by the server itself."""
    seconds = 30 * 86400
    step = seconds / rows
    chunk = 1_000_000
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        for low in range(0, rows, chunk):
            high = min(rows, low + chunk)
            conn.execute(
                f"""INSERT INTO traffic_record (target_id, node, gateway, request_id, caller, caller_kind,
                    key_hash, model, started_at, received_at, status_code, stream, finish_reason,
                    latency_seconds, ttft_seconds, prompt_chars, prompt_bytes, prompt_messages, prompt_tokens,
                    completion_tokens, cached_tokens, estimated_prompt_tokens, kv_pool_tokens, verdict, own,
                    checks, findings, expires_at)
                SELECT 1 + g %% {TARGETS}, '', 'gw', 'req-' || g, 'caller-' || (g %% 5003), 'team', '', 'm',
                    %(start)s + (g * {step}) * interval '1 second',
                    %(start)s + (g * {step}) * interval '1 second',
                    CASE WHEN g %% 17 = 0 THEN 500 ELSE 200 END, g %% 2 = 0, 'stop', 1.5, 0.2,
                    900 + g %% 3000, 900 + g %% 3000, 1, 1, 24, NULL, 900 + g %% 3000, {POOL},
                    CASE WHEN 900 + g %% 3000 > {POOL} THEN 'mismatch' ELSE 'pass' END, g %% 41 = 0,
                    CASE WHEN 900 + g %% 3000 > {POOL} THEN ',capacity,' ELSE '' END, '{{}}'::json,
                    %(start)s + interval '60 days'
                FROM generate_series({low}, {high - 1}) g""",
                {"start": NOW - timedelta(days=30)},
            )
            print(f"  {high:,} rows", file=sys.stderr)
        minutes = 30 * 1440
        conn.execute(
            f"""INSERT INTO traffic_minute (target_id, node, caller, minute, records, answered, flagged,
                near_pool, own, max_prompt_chars)
            SELECT t, '', 'caller-' || c, date_trunc('minute', %(start)s) + m * interval '1 minute',
                   40, 38, 2, 3, 1, 4000
            FROM generate_series(1, {TARGETS}) t, generate_series(0, {minutes - 1}) m,
                 generate_series(1, 2) c""",
            {"start": NOW - timedelta(days=30)},
        )
        conn.execute("VACUUM ANALYZE traffic_record")  # what autovacuum does: index-only scans need it
        conn.execute("VACUUM ANALYZE traffic_minute")


def make_incidents(factory: Any) -> tuple[int, int]:
    """A capacity incident on t1, 13 days long (the pool below the window, then fixed), and a
    cross_tenant leak on t1 still open."""

    def record(probe: str, result: ProbeResult, at: datetime) -> Any:
        with factory.begin() as s:
            return record_result(
                s, target_name="t1", engine="reference", base_url="http://10.0.0.1:8000/v1", model="m",
                probe=probe, result=result, started_at=at, duration_seconds=0.1,
                policy=IncidentConfig(resolve_after_passes=1), retention=RetentionConfig(), now=at,
            )  # fmt: skip

    fine = ProbeResult(Verdict.PASS, "headroom_ok", "", {"pools": {"prefill": 16384}})
    below = ProbeResult(Verdict.MISMATCH, "pool_below_context_window", "", {"pools": {"prefill": POOL}})
    start = NOW - timedelta(days=16)
    record("capacity", fine, start - timedelta(hours=1))
    opened = record("capacity", below, start)
    record("capacity", fine, start + timedelta(days=13))
    record("cross_tenant", ProbeResult(Verdict.PASS, "ok"), NOW - timedelta(days=2))
    leak = record("cross_tenant", ProbeResult(Verdict.LEAK, "foreign_marker", "", {"marker_ids": ["m"]}), NOW)
    return int(opened.incident_id), int(leak.incident_id)


def timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        begin = time.perf_counter()
        fn()
        out.append(time.perf_counter() - begin)
    return out


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def bench_postgres(rows: int, repeat: int) -> dict[str, Any]:
    name = f"kvcanary_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG} dbname=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        upgrade(url)
        engine = make_engine(url)
        factory = make_session_factory(engine)
        config = settings()
        with factory.begin() as s:
            ids = upsert_targets(s, [(t.name, t.engine, t.base_url, t.model) for t in config.targets], NOW)
        assert sorted(ids.values()) == list(range(1, TARGETS + 1)), ids  # the fill's ids
        over_pool, at_risk = make_incidents(factory)
        begin = time.perf_counter()
        fill_rows(url, rows)
        filled = time.perf_counter() - begin
        sources = BlastSources(chars_per_token=lambda _t: 1.0)
        out: dict[str, Any] = {"rows": rows, "fill_seconds": round(filled, 1)}
        for label, incident in (("over_pool", over_pool), ("at_risk", at_risk)):

            def once(incident: int = incident) -> Any:
                with factory() as s:
                    return blast_radius(s, incident, config, sources)

            found = once()
            samples = timed(once, repeat)
            out[label] = {
                "responses": found.responses if found else None,
                "p50_s": round(statistics.median(samples), 3),
                "p99_s": round(p99(samples), 3),
            }
        engine.dispose()
        return out
    finally:
        with psycopg.connect(f"{PG} dbname=postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def write_logs(folder: Path, megabytes: int) -> Path:
    """LiteLLM standard logging payloads, one per line, ``megabytes`` of them."""
    rng = random.Random(19)
    path = folder / "litellm.jsonl"
    words = ("invoice", "shipment", "warranty", "battery", "charger", "router", "refund")  # fmt: skip
    start = (NOW - timedelta(days=20)).timestamp()
    with path.open("w") as out:
        i = 0
        while out.tell() < megabytes * 1_000_000:
            chars = rng.choice([200, 600, 1500, 3000, 6000])
            text = " ".join(rng.choice(words) for _ in range(chars // 7))
            t = start + i * 2.0
            metadata = {
                "user_api_key_hash": f"{i % 977:064x}",
                "user_api_key_alias": f"key-{i % 977}",
                "user_api_key_team_id": f"team-{i % 211}",
                "requester_ip_address": "10.1.2.3",
            }
            payload = {
                "id": f"chatcmpl-{i:09d}", "call_type": "acompletion", "stream": i % 2 == 0,
                "status": "success" if i % 23 else "failure", "startTime": t, "endTime": t + 1,
                "model": "m", "model_group": "shop", "api_base": f"http://10.0.0.{1 + i % TARGETS}:8000/v1",
                "prompt_tokens": 1 if chars > POOL else chars, "completion_tokens": 24, "total_tokens": 25,
                "metadata": metadata, "end_user": None,
                "messages": [{"role": "system", "content": "You are a support assistant."},
                             {"role": "user", "content": text}],
                "response": {"choices": [{"message": {"content": text[:400]}}]},
            }  # fmt: skip
            out.write(json.dumps(payload) + "\n")
            i += 1
    return path


def bench_logs(megabytes: int, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = write_logs(Path(folder), megabytes)
        size = path.stat().st_size
        parquet = Path(folder) / "litellm.parquet"
        copy = f"COPY (SELECT * FROM read_json('{path}', format='newline_delimited')) TO '{parquet}'"
        duckdb.sql(copy + " (FORMAT parquet)")
        window = Window(Bound(NOW - timedelta(days=20), "bench"), Bound(NOW, "bench"))
        scope = Scope("t1", 1, "", window, Criterion("over_pool", "over the pool", pool_tokens=POOL),
                      ("http://10.0.0.1:8000",), 1.0)  # fmt: skip
        out: dict[str, Any] = {
            "json_mb": round(size / 1e6, 1),
            "parquet_mb": round(parquet.stat().st_size / 1e6, 1),
        }
        for label, pattern in (("json_lines", str(path)), ("parquet", str(parquet))):
            tally = logs_tally([(pattern, "auto")], scope, threads=1)
            samples = timed(lambda pattern=pattern: logs_tally([(pattern, "auto")], scope, threads=1), repeat)
            best = min(samples)
            out[label] = {
                "matched": tally.responses, "rows": tally.rows_read, "best_s": round(best, 2),
                "json_mb_per_s": round(size / 1e6 / best, 1),
            }  # fmt: skip
        return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--log-mb", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--only", choices=["postgres", "logs"], default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if args.only in (None, "logs"):
        result["logs"] = bench_logs(args.log_mb, max(3, args.repeat // 5))
        print(json.dumps(result["logs"]), file=sys.stderr)
    if args.only in (None, "postgres"):
        result["postgres"] = bench_postgres(args.rows, args.repeat)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
