"""Engines, the schema's own guarantees, and the read functions, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.storage import queries
from kvcanary.monitor.storage.db import make_engine, upgrade
from kvcanary.monitor.storage.incident_rows import open_incident_counts
from kvcanary.monitor.storage.models import Incident, ProbeResultRow, Target, public_url
from tests.support.monitor_db import T0, minutes, record

Factory = sessionmaker[Session]


def test_sqlite_engines_use_wal_and_enforce_foreign_keys(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'k.db'}")
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar_one() == 1
    finally:
        engine.dispose()


def test_timestamps_come_back_aware_and_in_utc(session_factory: Factory) -> None:
    paris = timezone(timedelta(hours=1))
    out = record(session_factory, "pass", at=datetime(2026, 11, 29, 13, 0, tzinfo=paris))
    naive = record(session_factory, "pass", at=datetime(2026, 11, 29, 14, 0), probe="canary")

    with session_factory() as s:
        started = s.get_one(ProbeResultRow, out.result_id).started_at
        naive_started = s.get_one(ProbeResultRow, naive.result_id).started_at
    assert started == T0 and started.utcoffset() == timedelta(0)
    assert naive_started == datetime(2026, 11, 29, 14, 0, tzinfo=UTC), "naive is taken as UTC"


def test_the_database_refuses_a_second_open_incident_for_a_pair(session_factory: Factory) -> None:
    opened = record(session_factory, "leak", at=T0)
    with session_factory() as s, s.begin():
        first = s.get_one(Incident, opened.incident_id)
        twin = {c: getattr(first, c) for c in ("target_id", "probe", "severity", "title", "opened_at")}
        extra = dict(
            last_failure_at=T0, failure_count=1, consecutive_passes=0, last_verdict="leak", last_reason="x"
        )
        s.add(Incident(**twin, **extra, state="resolved"))  # a resolved twin is fine
        s.flush()
        with pytest.raises(IntegrityError), s.begin_nested():
            s.add(Incident(**twin, **extra, state="open"))


def test_the_database_refuses_an_unknown_verdict(session_factory: Factory) -> None:
    record(session_factory, "pass", at=T0)
    with session_factory() as s, pytest.raises(IntegrityError):
        s.execute(text("UPDATE probe_result SET verdict = 'fine'"))
        s.flush()


def test_public_url_drops_credentials_and_query() -> None:
    assert (
        public_url("https://svc:s3cr3t@gpu-7.internal:8443/v1?api_key=k#x")
        == "https://gpu-7.internal:8443/v1"
    )
    assert public_url("http://[::1]:8000") == "http://[::1]:8000"
    assert public_url("http://127.0.0.1:30000/v1") == "http://127.0.0.1:30000/v1"


def seed(factory: Factory) -> dict[str, int | None]:
    """Incidents on two targets: an open critical, a resolved high, an open warning-free pass history."""
    ids = {
        "critical": record(
            factory, "leak", at=minutes(0), target="glm-prod", probe="cross_tenant"
        ).incident_id,
        "high": record(factory, "mismatch", at=minutes(10), target="glm-prod", probe="boundary").incident_id,
    }
    for i in (11, 12, 13):
        record(factory, "pass", at=minutes(i), target="glm-prod", probe="boundary")
    ids["dev"] = record(factory, "leak", at=minutes(20), target="llama-dev", probe="cross_tenant").incident_id
    record(factory, "pass", at=minutes(21), target="llama-dev", probe="canary", latency_seconds=0.1)
    return ids


def test_list_incidents_filters_and_pages(session_factory: Factory) -> None:
    ids = seed(session_factory)
    with session_factory() as s:
        everything = queries.list_incidents(s)
        open_prod = queries.list_incidents(s, target="glm-prod", state="open")
        first = queries.list_incidents(s, limit=1)
        second = queries.list_incidents(s, limit=1, after=first.next_key)
        by_offset = queries.list_incidents(s, limit=1, offset=1)
        window = queries.list_incidents(s, since=minutes(5), until=minutes(20))
        high = queries.list_incidents(s, severity="high", probe="boundary")

    assert [i.id for i in everything.rows] == [ids["dev"], ids["high"], ids["critical"]]
    assert everything.next_key is None
    assert [i.id for i in open_prod.rows] == [ids["critical"]]
    # An incident opens when its result is recorded, a second after the run started.
    assert [i.id for i in first.rows] == [ids["dev"]]
    assert first.next_key == queries.Key(minutes(20) + timedelta(seconds=1), ids["dev"] or 0)
    assert [i.id for i in second.rows] == [i.id for i in by_offset.rows] == [ids["high"]]
    assert [i.id for i in window.rows] == [ids["high"]], "since is inclusive, until exclusive"
    assert [(i.id, i.state, i.target) for i in high.rows] == [(ids["high"], "resolved", "glm-prod")]


def test_get_incident_returns_the_timeline_and_recent_evidence(session_factory: Factory) -> None:
    ids = seed(session_factory)
    with session_factory() as s:
        detail = queries.get_incident(s, incident_id=ids["high"] or 0, results_limit=2)
        missing = queries.get_incident(s, incident_id=10_000)

    assert missing is None and detail is not None
    assert (detail.incident.id, detail.incident.target) == (ids["high"], "glm-prod")
    assert [e.kind for e in detail.events] == ["opened", "resolved"]
    assert [r.started_at for r in detail.results] == [minutes(13), minutes(12)]


def test_list_probe_results_filters_by_verdict_and_time(session_factory: Factory) -> None:
    seed(session_factory)
    with session_factory() as s:
        passes = queries.list_probe_results(s, verdict="pass")
        dev = queries.list_probe_results(s, target="llama-dev", since=minutes(20), until=minutes(21))
        none = queries.list_probe_results(s, target="nobody")

    assert len(passes.rows) == 4 and [r.started_at for r in passes.rows][:2] == [minutes(21), minutes(13)]
    assert [(r.target, r.verdict) for r in dev.rows] == [("llama-dev", "leak")]
    assert (none.rows, none.next_key) == ([], None)


def test_last_verdicts_hold_each_pairs_latest_result(session_factory: Factory) -> None:
    seed(session_factory)
    record(session_factory, "error", at=minutes(13), target="glm-prod", probe="boundary", reason="timeout")
    pairs = [
        (t, p) for t in ("glm-prod", "llama-dev", "absent") for p in ("cross_tenant", "boundary", "canary")
    ]
    with session_factory() as s:
        last = queries.last_verdicts(s, pairs=pairs)
        only = queries.last_verdicts(s, pairs=[("llama-dev", "canary")])
        nothing = queries.last_verdicts(s, pairs=[])

    assert last["glm-prod"]["cross_tenant"] == ("leak", minutes(0), "foreign_marker", "")
    # Two results started at the same time: the one recorded last wins.
    assert last["glm-prod"]["boundary"] == ("error", minutes(13), "timeout", "")
    assert set(last["llama-dev"]) == {"cross_tenant", "canary"} and set(last) == {"glm-prod", "llama-dev"}
    assert only == {"llama-dev": {"canary": ("pass", minutes(21), "ok", "")}} and nothing == {}


def test_open_incident_counts_group_the_open_ones(session_factory: Factory) -> None:
    seed(session_factory)
    with session_factory() as s:
        counts = open_incident_counts(s)

    assert counts == [
        ("glm-prod", "cross_tenant", "", "critical", "certain", 1),
        ("llama-dev", "cross_tenant", "", "critical", "certain", 1),
    ]


def test_no_column_of_any_table_holds_a_credential(session_factory: Factory) -> None:
    record(session_factory, "leak", at=T0)
    with session_factory() as s:
        urls = s.scalars(select(Target.base_url)).all()
    assert urls == ["http://127.0.0.1:30000/v1"]
    # A SHA-256 digest of a caller's key (``traffic_record.key_hash``, what a gateway reports and
    # a blast radius excludes the monitor's own tenants by) is no credential: nothing signs in with
    # it. The wire takes 64 hex digits there and nothing else (tests/monitor/traffic/test_traffic_api.py).
    digests = {"key_hash"}
    columns = {c.name for t in Target.metadata.sorted_tables for c in t.columns} - digests
    assert not {c for c in columns if "key" in c or "token" in c.replace("tokens", "") or "secret" in c}


def test_upgrade_is_idempotent(db_url: str) -> None:
    upgrade(db_url)
    upgrade(db_url)


def test_odd_text_and_numbers_from_an_engine_are_recorded_on_both_databases(session_factory: Factory) -> None:
    # An engine's error message may carry a NUL and a measurement may be NaN: PostgreSQL refuses both
    # raw, and losing the recording of a failure to that would be worse than the oddity.
    outcome = record(session_factory, "mismatch", at=T0, detail="bad\x00answer", latency_seconds=float("nan"))
    with session_factory() as s:
        row = s.get(ProbeResultRow, outcome.result_id)
        assert row is not None and row.detail == "badanswer"
