"""Blast radii over a real database (SQLite and PostgreSQL), real DuckDB and the service's own app.

An incident is made by the incident rules from capacity results (the pool falls below the window,
then is fixed); gateway traffic goes through the real ingest path (``POST /api/v1/traffic``) and
the same requests are written as LiteLLM's logging payloads (JSON lines and Parquet). Each source
must give the ground truth the test computes from what it sent: every over-pool request answered
2xx in the window, per caller, none of the monitor's own, the listed callers apart.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.blast.compute import BlastSources, as_csv, blast_radius, request_rows
from kvcanary.monitor.blast.logs import GatewayLogs
from kvcanary.monitor.blast.recorded import RecordedTraffic
from kvcanary.monitor.blast.window import window_of
from kvcanary.monitor.config.settings import IncidentConfig, RetentionConfig
from kvcanary.monitor.incidents import record_result
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.run_now import RunNow
from kvcanary.monitor.storage.models import Incident
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.ingest import HttpIngest
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.pipeline import TrafficPipeline
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from kvcanary.wire import VERSION
from tests.support.monitor_app import settings_with_targets

Factory = sessionmaker[Session]
TOKEN = "kvc-test-token-0123456789abcdef"
BASE = "http://127.0.0.1:30000/v1"  # glm-prod's base_url
OWN_KEY = "sk-kvcanary-canary-tenant-key"
OWN_HASH = hashlib.sha256(OWN_KEY.encode()).hexdigest()
CALLERS = ["acme", "globex", "initech", "reporter"]
POOL = 1024
NOW = datetime.now(UTC).replace(microsecond=0)
FIXED = IncidentConfig(resolve_after_passes=2)


@dataclass
class Answers:
    """The target client's answers the judge asks for (network calls): one byte, one token."""

    calibration: TokenCalibration
    pool: int = POOL

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        return ServerCapacity(kv_pool_tokens=self.pool)

    async def count_tokens(self, text: str) -> int | None:
        return len(text)


@dataclass
class Sent:
    id: str
    caller: str
    own: bool
    time: float
    chars: int
    status: int

    @property
    def over(self) -> bool:
        return self.chars > POOL and 200 <= self.status < 300


def capacity(verdict: str, pools: dict[str, int], at: datetime) -> ProbeResult:
    reason = "pool_below_context_window" if verdict == "mismatch" else "headroom_ok"
    evidence = {
        "node": "",
        "pools": pools,
        "context_window": 8192,
        "version": "0.5.9",
        "disaggregation_mode": "prefill",
    }
    return ProbeResult(Verdict(verdict), reason, f"pools {pools}", evidence)


def record(factory: Factory, result: ProbeResult, at: datetime, probe: str = "capacity") -> Any:
    with factory.begin() as s:
        return record_result(
            s, target_name="glm-prod", engine="sglang", base_url=BASE, model="glm-5.3", probe=probe,
            result=result, started_at=at, duration_seconds=0.1, policy=FIXED, retention=RetentionConfig(),
            now=at,
        )  # fmt: skip


def capacity_incident(factory: Factory) -> int:
    """Pool fine 3 h ago, below the window from 2 h ago, fixed (two passes) 30 minutes ago."""
    record(factory, capacity("pass", {"prefill": 16384}, NOW), NOW - timedelta(hours=3))
    opened = record(
        factory, capacity("mismatch", {"prefill": POOL, "decode": 8192}, NOW), NOW - timedelta(hours=2)
    )
    record(factory, capacity("mismatch", {"prefill": POOL, "decode": 8192}, NOW), NOW - timedelta(minutes=90))
    for minutes in (31, 30):
        record(factory, capacity("pass", {"prefill": 16384}, NOW), NOW - timedelta(minutes=minutes))
    assert opened.change == "opened"
    return int(opened.incident_id)


def traffic(seed: int = 5) -> list[Sent]:
    """Requests from 4 h ago to now: four callers and the monitor's own, mixed sizes and statuses."""
    rng = random.Random(seed)
    sent = []
    for i in range(400):
        own = i % 10 == 0
        caller = "kvcanary" if own else rng.choice(CALLERS)
        t = (NOW - timedelta(hours=4)).timestamp() + i * 36 + rng.random()
        chars = rng.choice([300, 700, 1500, 3000])
        status = 200 if rng.random() < 0.9 else 500
        sent.append(Sent(f"call-{i:04d}", caller, own, t, chars, status))
    return sent


def tap_record(s: Sent) -> dict[str, Any]:
    return {
        "id": s.id, "time": s.time, "caller": s.caller, "caller_kind": "team",
        "key_hash": OWN_HASH if s.own else "", "api_base": BASE, "status": s.status,
        "prompt": {"chars": s.chars, "bytes": s.chars, "messages": 1},
        "usage": {"prompt_tokens": 1 if s.chars > POOL else s.chars, "completion_tokens": 20},
    }  # fmt: skip


def litellm_payload(s: Sent) -> dict[str, Any]:
    """LiteLLM's standard logging payload of the request (the fields a log holds, text included)."""
    metadata = {"user_api_key_team_id": s.caller, "user_api_key_hash": OWN_HASH if s.own else "h" * 64,
                "user_api_key_alias": f"{s.caller}-key", "requester_ip_address": "10.0.0.7"}  # fmt: skip
    return {
        "id": s.id, "trace_id": "t", "call_type": "acompletion", "stream": False,
        "status": "success" if s.status == 200 else "failure", "startTime": s.time, "endTime": s.time + 1.5,
        "model": "kvcanary-reference", "model_group": "shop", "api_base": BASE,
        "prompt_tokens": 1 if s.chars > POOL else s.chars, "completion_tokens": 20, "metadata": metadata,
        "messages": [{"role": "user", "content": "w" * s.chars}],
        "response": {"choices": [{"message": {"content": "an answer"}}]}, "end_user": None,
        "error_information": None if s.status == 200 else {"error_code": str(s.status)},
    }  # fmt: skip


def truth(sent: list[Sent], start: datetime, end: datetime, exclude: set[str]) -> dict[str, int]:
    inside = [s for s in sent if start.timestamp() <= s.time <= end.timestamp() and s.over and not s.own]
    return dict(Counter(s.caller for s in inside if s.caller not in exclude))


@pytest.fixture
def app(session_factory: Factory) -> Iterator[tuple[TestClient, TrafficJudge]]:
    settings = settings_with_targets()
    with session_factory.begin() as s:
        upsert_targets(
            s, [(t.name, t.engine, t.base_url, t.model) for t in settings.targets], NOW - timedelta(days=1)
        )
    calibrated = TokenCalibration()
    calibrated.note(1000, 1000)
    metrics = MonitorMetrics(CollectorRegistry())
    judge = TrafficJudge(
        settings, {"glm-prod": Answers(calibrated)}, MarkerBook(), metrics, own_keys={OWN_HASH}
    )
    state = ApiState(
        session_factory=session_factory, api_token=TOKEN, settings=settings,
        run_now=RunNow(_no_run, min_interval=0), health=lambda: {}, metrics_page=metrics.exposition,
        traffic=HttpIngest(TrafficPipeline(judge, None, session_factory)), judge=judge,
    )  # fmt: skip
    with TestClient(build_http_app(state)) as client:
        yield client, judge


async def _no_run(name: str) -> list[dict[str, Any]]:
    raise KeyError(name)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def post_traffic(client: TestClient, sent: list[Sent]) -> None:
    for i in range(0, len(sent), 100):
        body = {"version": VERSION, "gateway": "gw", "records": [tap_record(s) for s in sent[i : i + 100]]}
        assert client.post("/api/v1/traffic", json=body, headers=auth()).status_code == 200


def by_caller(radius: dict[str, Any]) -> dict[str, int]:
    return {c["caller"]: c["responses"] for c in radius["callers"]}


def test_an_over_pool_incident_counts_every_over_pool_2xx_in_its_window_per_caller(
    app: tuple[TestClient, TrafficJudge], session_factory: Factory
) -> None:
    client, _ = app
    incident = capacity_incident(session_factory)
    sent = traffic()
    post_traffic(client, sent)
    answer = client.get(
        f"/api/v1/incidents/{incident}/blast-radius", params={"exclude": "reporter"}, headers=auth()
    )
    assert answer.status_code == 200, answer.text
    radius = answer.json()
    start, end = NOW - timedelta(hours=2), NOW - timedelta(minutes=30)
    assert radius["window"]["start"].startswith(start.isoformat().replace("+00:00", ""))
    assert "first capacity reading" in radius["window"]["start_how"]
    assert radius["window"]["end"].startswith(end.isoformat().replace("+00:00", ""))
    assert radius["criterion"]["kind"] == "over_pool" and radius["criterion"]["pool_tokens"] == POOL
    expected = truth(sent, start, end, {"reporter"})
    assert by_caller(radius) == expected and sum(expected.values()) > 20
    assert radius["affected_responses"] == sum(expected.values()) and radius["at_risk_responses"] is None
    excluded = {(e["caller"], e["reason"]): e["responses"] for e in radius["excluded"]}
    own = sum(1 for s in sent if s.own and s.over and start.timestamp() <= s.time <= end.timestamp())
    assert excluded[("kvcanary", "the monitor's own canary tenants (their key hash)")] == own > 0
    reporter = truth(sent, start, end, set())["reporter"]
    assert excluded[("reporter", "listed by the operator")] == reporter > 0
    assert sum(radius["series"]["counts"]) == radius["affected_responses"]
    assert [s["name"] for s in radius["sources"] if s["primary"]] == ["recorded traffic"]
    first = min(
        s.time
        for s in sent
        if s.caller == "acme" and s.over and start.timestamp() <= s.time <= end.timestamp()
    )
    acme = next(c for c in radius["callers"] if c["caller"] == "acme")
    assert abs(datetime.fromisoformat(acme["first"]).timestamp() - int(first)) <= 1
    assert any("0.5.9" in line for line in radius["disclosure"])


def test_gateway_logs_as_json_lines_and_parquet_give_the_same_answer(
    app: tuple[TestClient, TrafficJudge], session_factory: Factory, tmp_path: Path
) -> None:
    incident = capacity_incident(session_factory)
    sent = traffic(seed=9)
    lines = [json.dumps(litellm_payload(s)) for s in sent]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:200]) + "\nnot a record\n")
    (tmp_path / "b.jsonl").write_text("\n".join(lines[200:]) + "\n")
    duckdb.sql(
        f"COPY (SELECT * FROM read_json('{tmp_path}/*.jsonl', format='newline_delimited', "
        f"ignore_errors=true) WHERE id IS NOT NULL) TO '{tmp_path}/all.parquet' (FORMAT parquet)"
    )
    start, end = NOW - timedelta(hours=2), NOW - timedelta(minutes=30)
    expected = truth(sent, start, end, set())
    for pattern in (f"{tmp_path}/*.jsonl", f"{tmp_path}/*.parquet"):
        sources = BlastSources((RecordedTraffic(), GatewayLogs([(pattern, "auto")])),
                               own_keys=frozenset({OWN_HASH}), chars_per_token=lambda _t: 1.0)  # fmt: skip
        with session_factory() as s:
            radius = blast_radius(s, incident, settings_with_targets(), sources)
            assert radius is not None and radius.primary is not None
            assert radius.primary.name == "gateway logs", radius.as_json()["sources"]
            assert {c: n.responses for c, n in radius.callers()} == expected
            rows = request_rows(s, radius)
        ids = {s.id for s in sent if s.over and not s.own and start.timestamp() <= s.time <= end.timestamp()}
        assert {rid for rid, _, _ in rows} == ids
        assert as_csv(rows, radius).count("\n") == len(ids) + 1
        unreadable = [n for n in radius.as_json()["sources"][1]["notes"] if "no log record" in n]
        # The JSON lines hold one line that is no record; the Parquet was written without it.
        assert unreadable == (
            ["1 line(s) were no log record of their format and were skipped"] if "jsonl" in pattern else []
        )
    # Nothing recorded by the tap: the recorded source says so, and is not the one counted.
    recorded = radius.as_json()["sources"][0]
    assert recorded["covered"] is False and recorded["responses"] is None


def test_no_traffic_source_is_unknown_not_zero_and_bad_requests_get_4xx(
    app: tuple[TestClient, TrafficJudge], session_factory: Factory
) -> None:
    client, _ = app
    incident = capacity_incident(session_factory)
    radius = client.get(f"/api/v1/incidents/{incident}/blast-radius", headers=auth()).json()
    assert radius["affected_responses"] is None and radius["callers"] == []
    assert "unknown, not zero" in radius["note"]
    assert client.get(f"/api/v1/incidents/{incident}/blast-radius").status_code == 401
    assert client.get("/api/v1/incidents/999999/blast-radius", headers=auth()).status_code == 404
    assert client.get("/api/v1/incidents/0/blast-radius", headers=auth()).status_code == 422
    long = {"exclude": "x" * 201}
    assert (
        client.get(f"/api/v1/incidents/{incident}/blast-radius", params=long, headers=auth()).status_code
        == 422
    )


def test_a_probe_leak_counts_every_request_to_the_node_as_at_risk_from_the_last_pass(
    app: tuple[TestClient, TrafficJudge], session_factory: Factory
) -> None:
    client, _ = app
    canary = ProbeResult(Verdict.PASS, "ok", "own nonce back")
    leak = ProbeResult(Verdict.LEAK, "foreign_marker", "another tenant's marker", {"marker_ids": ["m"]})
    record(session_factory, canary, NOW - timedelta(hours=3, minutes=5), probe="cross_tenant")
    opened = record(session_factory, leak, NOW - timedelta(hours=1), probe="cross_tenant")
    sent = traffic(seed=3)
    post_traffic(client, sent)
    radius = client.get(f"/api/v1/incidents/{opened.incident_id}/blast-radius", headers=auth()).json()
    assert radius["criterion"]["kind"] == "at_risk" and radius["affected_responses"] is None
    assert radius["window"]["start_how"] == "the last pass of cross_tenant before its first failure"
    assert radius["window"]["end_how"].startswith("still open")
    start = (NOW - timedelta(hours=3, minutes=5)).replace(second=0)
    ok = [s for s in sent if s.status == 200 and not s.own and s.time >= start.timestamp()]
    assert radius["at_risk_responses"] == len(ok)
    assert by_caller(radius) == dict(Counter(s.caller for s in ok))


def test_the_incident_page_shows_the_counts_the_callers_a_chart_and_the_disclosure(
    app: tuple[TestClient, TrafficJudge], session_factory: Factory
) -> None:
    client, _ = app
    incident = capacity_incident(session_factory)
    sent = traffic(seed=11)
    post_traffic(client, sent)
    page = client.get(f"/incidents/{incident}", headers=auth())
    assert page.status_code == 200, page.text
    html = page.text
    start, end = NOW - timedelta(hours=2), NOW - timedelta(minutes=30)
    expected = truth(sent, start, end, set())
    section = html[html.index("<h2>Blast radius</h2>") : html.index("<h2>Timeline</h2>")]
    assert f"<b>{sum(expected.values())}</b>" in section
    for caller, n in expected.items():
        assert f"<tr><td>{caller}</td><td>{n}</td>" in section
    assert section.count("<rect ") >= 2 and "<script" not in html
    assert "Disclosure summary" in section and "engine version 0.5.9" in section
    assert "the monitor&#39;s own canary tenants" in section


def test_sources_are_compared_by_the_minute_so_exact_logs_are_not_outranked_by_minute_counts() -> None:
    # A 4-minute window from 12:00:00; the same traffic ran 12:00:50-12:03:10. The tap counts it by
    # the minute (12:00-12:04); the logs hold the exact times: 2 min 20 s of 4, 0.42 below the tap.
    from kvcanary.monitor.blast.question import Bound, Criterion, Scope, Window
    from kvcanary.monitor.blast.report import BlastRadius
    from kvcanary.monitor.blast.source import Tally

    t0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    window = Window(Bound(t0, "start"), Bound(t0 + timedelta(minutes=4), "end"))
    scope = Scope("shared", 1, "node", window, Criterion("over_pool", "over the pool"), ("x",), None)
    epoch = t0.timestamp()
    recorded, gateway_logs = RecordedTraffic(), GatewayLogs([])
    tap = Tally("recorded traffic", "rows", covered=True, span=(epoch, epoch + 240), source=recorded)
    logs = Tally("gateway logs", "*.jsonl", covered=True, span=(epoch + 50, epoch + 190), source=gateway_logs)
    assert (
        logs.coverage(scope.start_epoch, scope.end_epoch)
        < tap.coverage(scope.start_epoch, scope.end_epoch) - 0.4
    )
    assert BlastRadius({}, scope, [tap, logs]).primary is logs
    # Logs that miss whole minutes the tap saw (rotated away) still lose to it.
    rotated = Tally(
        "gateway logs", "*.jsonl", covered=True, span=(epoch + 130, epoch + 190), source=gateway_logs
    )
    assert BlastRadius({}, scope, [tap, rotated]).primary is tap


def blast_app(factory: Factory, blast: dict[str, Any]) -> TestClient:
    """The service's app with ``blast`` as its ``blast_radius`` configuration (no traffic judge)."""
    from kvcanary.monitor.config.settings import Settings
    from tests.support.monitor_app import build_app

    settings = Settings.model_validate({**settings_with_targets().model_dump(), "blast_radius": blast})
    with factory.begin() as s:
        upsert_targets(
            s, [(t.name, t.engine, t.base_url, t.model) for t in settings.targets], NOW - timedelta(days=1)
        )
    return TestClient(build_app(factory, settings=settings, token=TOKEN))


def test_the_api_and_the_page_show_a_spend_log_url_as_scheme_host_port_and_database_only(
    session_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A password in the URL's query is masked as ``user:pw@`` is, in the API and on the page."""
    url = "postgresql://spender:hunter1@127.0.0.1:1/litellm?password=hunter2&sslpassword=hunter3#hunter4"
    monkeypatch.setenv("KVC_TEST_LITELLM_DB", url)
    with blast_app(session_factory, {"litellm_db_url_env": "KVC_TEST_LITELLM_DB"}) as client:
        incident = capacity_incident(session_factory)
        answer = client.get(f"/api/v1/incidents/{incident}/blast-radius", headers=auth())
        page = client.get(f"/incidents/{incident}", headers=auth())
    assert answer.status_code == 200 and page.status_code == 200
    read = {s["name"]: s["read"] for s in answer.json()["sources"]}
    assert read["LiteLLM_SpendLogs"] == '"LiteLLM_SpendLogs" at postgresql://127.0.0.1:1/litellm'
    for shown in (answer.text, page.text):
        assert "hunter" not in shown and "spender" not in shown and "password" not in shown


def test_the_api_notes_a_configured_log_with_no_newline_without_quoting_or_naming_it(
    session_factory: Factory, tmp_path: Path
) -> None:
    """A configured log with no newline, as the API answers it: the file is left out with a note of
    its problem only."""
    import os

    from kvcanary.monitor.blast.logs import LONG_LINE

    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(b'{"id": "x", "messages": [{"content": "SECRET-PROMPT ')
    os.truncate(huge, 20 * 2**20)  # past the 16 MiB a line may take, with no newline
    with blast_app(session_factory, {"logs": [{"path": str(tmp_path / "*.jsonl")}]}) as client:
        incident = capacity_incident(session_factory)
        answer = client.get(f"/api/v1/incidents/{incident}/blast-radius", headers=auth())
        page = client.get(f"/incidents/{incident}", headers=auth())
    assert answer.status_code == 200 and page.status_code == 200
    notes = {s["name"]: s["notes"] for s in answer.json()["sources"]}
    assert notes["gateway logs"] == [LONG_LINE]
    assert "16 MiB" in page.text
    for shown in (answer.text, page.text):
        assert "SECRET" not in shown
    assert "huge" not in page.text  # the page names no path (the API's ``read`` gives the glob)


def test_a_pool_below_the_window_at_its_first_reading_counts_from_when_the_monitor_first_saw_it(
    session_factory: Factory,
) -> None:
    """No capacity reading was ever fine: the pool may have been below the window before the first
    one, and customers served meanwhile were exposed all the same."""
    seen = NOW - timedelta(hours=1)
    record(session_factory, ProbeResult(Verdict.PASS, "nonce_intact"), seen, probe="canary")
    opened = record(
        session_factory, capacity("mismatch", {"prefill": 1024}, NOW), NOW - timedelta(minutes=20)
    )
    with session_factory() as s:
        incident = s.get_one(Incident, opened.incident_id)
        window = window_of(s, incident, NOW)
    assert window.start.at == seen, window.start
    assert window.start.how.startswith("no capacity reading of the node was fine before its first below")
