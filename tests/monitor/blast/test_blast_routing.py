"""One routing rule (``kvcanary/wire.py``): a deployment's ``api_base``, however a gateway spells it,
reaches the same target in the judge, in the blast radius's gateway logs (DuckDB) and in LiteLLM's
spend log (real PostgreSQL), and the tap hashes it into the partition of the key the judge routes by.

The spellings vary the case of the scheme, the host and the path, a trailing ``/v1`` in any case,
trailing slashes and surrounding whitespace. Before the rule was one, the judge kept the path's
case and the SQL lower-cased it, and only the judge stripped whitespace: a spelling was counted by
one and unmatched by the other.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import psycopg
import pytest
from sqlalchemy import create_engine, text

from kvcanary.monitor.blast.compute import api_bases
from kvcanary.monitor.blast.logs import logs_tally
from kvcanary.monitor.blast.question import Bound, Criterion, Scope, Window
from kvcanary.monitor.blast.spendlogs import spendlogs_tally
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.routing import api_base_key, api_base_key_sql, routes_of
from kvcanary.tap.jetstream import partition_of
from tests.support import own_database

START = datetime(2026, 8, 27, 12, 0, tzinfo=UTC)
#: How the operator configured the gateway's route to the target (its own spelling, mixed case).
CONFIGURED = "http://Gateway.Example:4000/Team-A/V1"
#: How gateways log requests to that deployment: every one must reach the target.
ROUTED = [
    "http://gateway.example:4000/team-a/v1",
    "HTTP://GATEWAY.EXAMPLE:4000/TEAM-A/V1/",
    "http://gateway.example:4000/Team-A",
    "http://gateway.example:4000/team-a/",
    "  http://Gateway.Example:4000/Team-A/v1//  ",
    "\thttp://gateway.example:4000/team-a///V1\n",
    "http://gateway.example:4000/TEAM-a//",
]
#: Other deployments: none may reach it.
UNROUTED = [
    "http://gateway.example:4000/team-b/v1",
    "http://gateway.example:4000/team-a/v2",
    "http://gateway.example:4000/team-a/v1/chat",
    "http://gateway.example:4001/team-a",
    "https://gateway.example:4000/team-a",
    "http://gateway.example:4000/team-a/v1x",
]
SPELLINGS = ROUTED + UNROUTED
#: Keys the SQL must compute as the wire does, odd ones included: a non-ASCII letter is left as it
#: is (each engine lower-cases those its own way), a non-ASCII space is no blank, one /v1 goes.
ODD = ["http://h/ÉTÉ/V1", "\u00a0http://h/v1", "http://h/v1/v1", "http://h//v1", "", "/", "/V1/", " \x0b\x0c"]

#: The columns of ``LiteLLM_SpendLogs`` the blast radius reads, typed as LiteLLM's migrations type them.
SPEND_LOGS = """CREATE TABLE "LiteLLM_SpendLogs" (
    request_id TEXT PRIMARY KEY, api_key TEXT NOT NULL DEFAULT '', "startTime" TIMESTAMP(3) NOT NULL,
    api_base TEXT DEFAULT '', team_id TEXT, end_user TEXT, status TEXT, prompt_tokens INTEGER DEFAULT 0,
    metadata JSONB DEFAULT '{}', proxy_server_request JSONB DEFAULT '{}')"""


def settings() -> Settings:
    target = {"name": "shop", "base_url": "http://10.0.0.1:8000/v1", "engine": "sglang", "model": "m",
              "tenants": [{"name": "alice"}, {"name": "bob"}], "gateway_api_bases": [CONFIGURED]}  # fmt: skip
    return Settings.model_validate({"targets": [target]})


def scope() -> Scope:
    """Every request to the target in the hour is at risk: a request counts exactly when it is routed."""
    window = Window(Bound(START, "test"), Bound(START + timedelta(hours=1), "test"))
    bases = api_bases(settings(), "shop", "", "http://10.0.0.1:8000/v1")
    return Scope("shop", 1, "", window, Criterion("at_risk", "every request"), bases, None)


def caller(i: int) -> str:
    return f"caller-{i:02d}"


def judged() -> set[str]:
    """The spellings' callers the judge routes to the target."""
    routes = routes_of(settings())
    return {caller(i) for i, base in enumerate(SPELLINGS) if routes.get(api_base_key(base)) == ("shop", "")}


@pytest.fixture
def spend_log_db() -> Iterator[str]:
    """A database holding a ``LiteLLM_SpendLogs`` table with one row per spelling."""
    database = own_database("kvcanary_routing")
    plain = next(database).replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(SPEND_LOGS)
            for i, base in enumerate(SPELLINGS):
                at = (START + timedelta(minutes=i + 1)).replace(tzinfo=None)
                conn.execute(
                    'INSERT INTO "LiteLLM_SpendLogs" (request_id, "startTime", api_base, team_id, status) '
                    "VALUES (%s, %s, %s, %s, 'success')",
                    (f"req-{i}", at, base, caller(i)),
                )
        yield plain
    finally:
        database.close()  # drops it


def test_every_spelling_of_a_deployment_is_routed_alike_by_the_judge_the_logs_and_the_spend_log(
    tmp_path: Path, spend_log_db: str
) -> None:
    expected = {caller(i) for i in range(len(ROUTED))}
    assert judged() == expected

    log = tmp_path / "gateway.jsonl"
    lines = [
        {"id": f"req-{i}", "time": (START + timedelta(minutes=i + 1)).timestamp(), "caller": caller(i),
         "api_base": base, "status": 200, "request": {"prompt": "hello"}}
        for i, base in enumerate(SPELLINGS)
    ]  # fmt: skip
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    logs = logs_tally([(str(log), "openai")], scope())
    assert set(logs.callers) == expected, logs.notes

    spend = spendlogs_tally(spend_log_db, scope())
    assert set(spend.callers) == expected, spend.notes


def test_the_sql_rule_computes_the_wire_key_in_duckdb_and_postgresql(spend_log_db: str) -> None:
    values = SPELLINGS + ODD
    select = " UNION ALL ".join(
        f"SELECT {i} AS n, {api_base_key_sql(f'CAST(${i + 1} AS VARCHAR)')} AS key"
        for i in range(len(values))
    )
    in_duckdb = dict(duckdb.execute(f"SELECT * FROM ({select}) ORDER BY n", values).fetchall())
    engine = create_engine(spend_log_db.replace("postgresql://", "postgresql+psycopg://"))
    try:
        marks = " UNION ALL ".join(
            f"SELECT {i} AS n, {api_base_key_sql(f'CAST(:v{i} AS TEXT)')} AS key" for i in range(len(values))
        )
        with engine.connect() as conn:
            rows = conn.execute(text(marks), {f"v{i}": v for i, v in enumerate(values)}).all()
        in_postgres = {n: key for n, key in rows}
    finally:
        engine.dispose()
    expected = {i: api_base_key(v) for i, v in enumerate(values)}
    assert in_duckdb == expected
    assert in_postgres == expected


def test_the_tap_partitions_every_spelling_by_the_key_the_judge_routes_by() -> None:
    for base in SPELLINGS + ODD:
        key = api_base_key(base)
        assert partition_of(base, 16) == zlib.crc32(key.encode()) % 16
    assert len({partition_of(base, 16) for base in ROUTED}) == 1
