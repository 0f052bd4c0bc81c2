"""Blast-radius sources behind one protocol (``monitor/blast/source.py``), held in one list.

Each source of the house meets ``BlastSource`` against what it really reads: the recorded traffic
on SQLite and PostgreSQL (filled through the real ingest), a gateway's log files through DuckDB,
and a ``LiteLLM_SpendLogs`` table on PostgreSQL, all holding the same requests, so each must
count the same callers and list the same ids. Then a newcomer: a source defined here, one class
reading a CSV export it is given, added to the list, shows in the report and, where it covers
the window best, gives the notification list; where the tap covers it better, the tap does.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.blast.compute import (
    BlastSources,
    blast_radius,
    configured_sources,
    request_rows,
    scope_of,
)
from kvcanary.monitor.blast.logs import GatewayLogs
from kvcanary.monitor.blast.question import Scope
from kvcanary.monitor.blast.recorded import RecordedTraffic
from kvcanary.monitor.blast.source import BlastSource, RequestRow, Tally
from kvcanary.monitor.blast.spendlogs import SpendLogs
from kvcanary.monitor.routing import routed_keys
from kvcanary.monitor.storage.models import Incident
from kvcanary.monitor.traffic.judge import TrafficJudge, api_base_key
from tests.monitor.blast.test_blast_radius import (  # noqa: F401 (app: a fixture, used by name)
    BASE,
    NOW,
    OWN_HASH,
    POOL,
    Sent,
    app,
    capacity_incident,
    litellm_payload,
    post_traffic,
    traffic,
    truth,
)
from tests.monitor.blast.test_blast_routing import SPEND_LOGS
from tests.support import own_database
from tests.support.monitor_app import settings_with_targets

Factory = sessionmaker[Session]
#: The capacity incident's window (``capacity_incident``): from the pool's fall to its fix.
START, END = NOW - timedelta(hours=2), NOW - timedelta(minutes=30)


def sources_with(*more: BlastSource, exclude: tuple[str, ...] = ()) -> BlastSources:
    return BlastSources((RecordedTraffic(), *more), exclude, frozenset({OWN_HASH}), lambda _t: 1.0)


def scope(factory: Factory, incident: int) -> Scope:
    with factory() as s:
        row = s.get(Incident, incident)
        assert row is not None
        return scope_of(s, row, settings_with_targets(), sources_with(), NOW)


def sent_once(seed: int) -> list[Sent]:
    """``traffic(seed)`` under ids of its own: the ingest takes a record id once per database."""
    return [dataclasses.replace(s, id=f"sources-{seed}-{s.id}") for s in traffic(seed)]


def matching(sent: list[Sent]) -> list[Sent]:
    """The requests the incident's criterion names: over the pool, answered 2xx, in the window."""
    return [s for s in sent if s.over and START.timestamp() <= s.time <= END.timestamp()]


def assert_meets_the_protocol(
    source: BlastSource, session: Session | None, scope: Scope, sent: list[Sent]
) -> None:
    """``source`` names itself, counts the callers the test sent and lists the same requests by id,
    the monitor's own marked, oldest first, no more than asked."""
    assert isinstance(source, BlastSource)
    assert source.name and "\n" not in source.about and isinstance(source.trust, int)
    tally = source.tally(session, scope)  # type: ignore[arg-type]  # None: a file or a URL needs no session
    assert tally.source is source and tally.name == source.name, tally
    assert tally.covered, tally.notes
    assert {c: n.responses for c, n in tally.callers.items()} == truth(sent, START, END, set())
    assert sum(n.responses for n in tally.own.values()) == sum(s.own for s in matching(sent)) > 0
    rows = source.requests(session, scope, 10_000)  # type: ignore[arg-type]
    assert sorted((rid, caller, own) for rid, caller, own, _ in rows) == sorted(
        (s.id, s.caller, s.own) for s in matching(sent)
    )
    assert [t for *_, t in rows] == sorted(t for *_, t in rows)
    assert len(source.requests(session, scope, 3)) == 3  # type: ignore[arg-type]


def test_the_recorded_traffic_meets_the_protocol_on_the_monitors_database(
    app: tuple[TestClient, TrafficJudge],  # noqa: F811 (the fixture imported above)
    session_factory: Factory,
) -> None:
    client, _ = app
    incident = capacity_incident(session_factory)
    sent = sent_once(21)
    post_traffic(client, sent)
    with session_factory() as s:
        assert_meets_the_protocol(RecordedTraffic(), s, scope(session_factory, incident), sent)


def test_gateway_logs_meet_the_protocol_through_duckdb(
    app: tuple[TestClient, TrafficJudge],  # noqa: F811
    session_factory: Factory,
    tmp_path: Path,
) -> None:
    incident = capacity_incident(session_factory)
    sent = sent_once(22)
    (tmp_path / "gateway.jsonl").write_text("".join(json.dumps(litellm_payload(s)) + "\n" for s in sent))
    logs = GatewayLogs([(str(tmp_path / "*.jsonl"), "auto")], threads=2)
    assert_meets_the_protocol(logs, None, scope(session_factory, incident), sent)


@pytest.fixture
def spend_log_url() -> Iterator[str]:
    """LiteLLM's database (its URL as an operator gives it): the spend log table, empty."""
    database = own_database("kvcanary_sources")
    plain = next(database).replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(SPEND_LOGS)
        yield plain
    finally:
        database.close()  # drops it


def spend_log_rows(url: str, sent: list[Sent]) -> None:
    """The rows LiteLLM writes for ``sent``, the prompt stored (``store_prompts_in_spend_logs``)."""
    rows = [
        (s.id, OWN_HASH if s.own else hashlib.sha256(s.caller.encode()).hexdigest(),
         datetime.fromtimestamp(s.time, UTC).replace(tzinfo=None), BASE, s.caller,
         "success" if s.status == 200 else "failure", 1 if s.chars > POOL else s.chars,
         json.dumps({"messages": [{"role": "user", "content": "w" * s.chars}]}))
        for s in sent
    ]  # fmt: skip
    with psycopg.connect(url, autocommit=True) as conn:
        conn.cursor().executemany(
            'INSERT INTO "LiteLLM_SpendLogs" (request_id, api_key, "startTime", api_base, team_id, status, '
            "prompt_tokens, proxy_server_request) VALUES (%s, %s, %s, %s, %s, %s, %s, %s::jsonb)",
            rows,
        )


@pytest.mark.external_service
def test_the_spend_log_meets_the_protocol_on_postgresql_and_never_shows_its_password(
    app: tuple[TestClient, TrafficJudge],  # noqa: F811
    session_factory: Factory,
    spend_log_url: str,
) -> None:
    incident = capacity_incident(session_factory)
    sent = sent_once(23)
    spend_log_rows(spend_log_url, sent)
    assert_meets_the_protocol(SpendLogs(spend_log_url), None, scope(session_factory, incident), sent)
    # The source as the configuration builds it: the password is in no repr and no report.
    secret = spend_log_url.replace("postgres@", "postgres:hunter2@")
    sources = configured_sources(
        settings_with_targets(), own_keys=frozenset(), chars_per_token=lambda _t: None, litellm_db=secret
    )
    assert [type(source) for source in sources.sources] == [RecordedTraffic, SpendLogs]
    assert "hunter2" not in repr(sources) and "postgres@" not in repr(sources)


class ExportedCounts:
    """A newcomer's source: a CSV export of a gateway's requests (id, caller, key_hash, time, api_base,
    status, prompt_chars), counted here in Python: everything a source is, in one class."""

    name = "exported counts"
    about = "a CSV export of the gateway's requests"
    trust = 5

    def __init__(self, path: Path):
        self.path = path

    def _read(self) -> list[dict[str, str]]:
        with self.path.open(newline="") as export:
            return list(csv.DictReader(export))

    def _rows(self, scope: Scope) -> list[RequestRow]:
        """The requests of the export that reach the node and match the criterion."""
        routed = routed_keys(scope.api_bases)
        return [
            (r["id"], r["caller"], r["key_hash"] in scope.own_keys, float(r["time"]))
            for r in self._read()
            if api_base_key(r["api_base"]) in routed and self._matches(r, scope)
        ]

    @staticmethod
    def _matches(row: dict[str, str], scope: Scope) -> bool:
        inside = scope.start_epoch <= float(row["time"]) <= scope.end_epoch
        tokens = int(row["prompt_chars"]) / (scope.chars_per_token or 1.0)
        return inside and row["status"].startswith("2") and tokens > (scope.criterion.pool_tokens or 0)

    def tally(self, session: Session, scope: Scope) -> Tally:
        tally = Tally(self.name, self.path.name, source=self)
        times = [float(r["time"]) for r in self._read()]
        tally.rows_read = len(times)
        tally.span = (min(times), max(times)) if times else None
        tally.covered = any(scope.start_epoch <= t <= scope.end_epoch for t in times)
        rows = self._rows(scope)
        tally.add_callers((caller, own, 1, t, t) for _, caller, own, t in rows)
        customers = [t for _, caller, own, t in rows if not own and caller not in scope.exclude]
        tally.add_buckets((int((t - scope.start_epoch) // scope.bucket_seconds), 1) for t in customers)
        return tally

    def requests(self, session: Session, scope: Scope, limit: int) -> list[RequestRow]:
        return sorted(self._rows(scope), key=lambda row: row[3])[:limit]


def export(path: Path, sent: list[Sent]) -> Path:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "caller", "key_hash", "time", "api_base", "status", "prompt_chars"])
        for s in sent:
            writer.writerow([f"export-{s.id}", s.caller, OWN_HASH if s.own else "", s.time, BASE, s.status,
                             s.chars])  # fmt: skip
    return path


def test_a_newcomers_source_is_one_class_in_the_list_and_counts_where_it_covers_best(
    app: tuple[TestClient, TrafficJudge],  # noqa: F811
    session_factory: Factory,
    tmp_path: Path,
) -> None:
    client, _ = app
    incident = capacity_incident(session_factory)
    sent = sent_once(24)
    newcomer = ExportedCounts(export(tmp_path / "export.csv", sent))
    assert isinstance(newcomer, BlastSource)
    sources = sources_with(newcomer, exclude=("reporter",))
    expected = truth(sent, START, END, {"reporter"})
    with session_factory() as s:  # no tap yet: the export alone covers the window
        radius = blast_radius(s, incident, settings_with_targets(), sources)
        assert radius is not None and radius.primary is not None
        listed = request_rows(s, radius)
    report = radius.as_json()
    assert [(x["name"], x["primary"]) for x in report["sources"]] == [
        ("recorded traffic", False),
        ("exported counts", True),
    ]
    assert report["sources"][1]["about"] == newcomer.about
    assert {c["caller"]: c["responses"] for c in report["callers"]} == expected
    assert report["disclosure"][-1] == "Counted from exported counts."
    assert sum(report["series"]["counts"]) == sum(expected.values())
    customers = [s for s in matching(sent) if not s.own and s.caller != "reporter"]
    assert sorted(rid for rid, _, _ in listed) == sorted(f"export-{s.id}" for s in customers)

    # The tap now delivers the whole window, and the export holds only its last 20 minutes:
    # the tap covers best, and both the figures and the list are its own.
    post_traffic(client, sent)
    late = [s for s in sent if s.time >= (END - timedelta(minutes=20)).timestamp()]
    export(tmp_path / "export.csv", late)
    with session_factory() as s:
        radius = blast_radius(s, incident, settings_with_targets(), sources)
        assert radius is not None and radius.primary is not None
        assert radius.primary.source is sources.sources[0], radius.as_json()["sources"]
        listed = request_rows(s, radius)
    assert sorted(rid for rid, _, _ in listed) == sorted(s.id for s in customers)
