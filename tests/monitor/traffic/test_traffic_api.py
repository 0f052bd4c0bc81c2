"""``/api/v1/traffic`` over a real database: who may post and read, bad input, kept records.

The judge is the service's own (``monitor/traffic/``); the only seam is the target client it asks
for a calibration and a capacity reading (network calls, stubbed as their answers).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.schemas import Problem
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.api.traffic import IngestOut, IngestRefusal
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.run_now import RunNow
from kvcanary.monitor.storage.models import TrafficMinute, TrafficRecordRow
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.ingest import HttpIngest
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.pipeline import TrafficPipeline
from kvcanary.monitor.traffic.refusals import ROWS_PER_MINUTE
from kvcanary.monitor.traffic.schema import MAX_BODY_BYTES, MAX_RECORDS
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from kvcanary.wire import VERSION
from tests.support.monitor_app import settings_with_targets

Factory = sessionmaker[Session]
TOKEN = "kvc-test-token-0123456789abcdef"
INGEST = "kvc-ingest-token-0123456789abcdef"
BASE = "http://127.0.0.1:30000/v1"  # glm-prod's base_url


@dataclass
class Answers:
    """What the target client would answer: its tokenizer's calibration, its pool."""

    calibration: TokenCalibration
    pool: int = 4096

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        return ServerCapacity(kv_pool_tokens=self.pool)

    async def count_tokens(self, text: str) -> int | None:
        self.calibration.note(len(text), len(text))
        return len(text)


@pytest.fixture
def client(session_factory: Factory) -> Iterator[TestClient]:
    settings = settings_with_targets()
    with session_factory.begin() as s:
        upsert_targets(s, [(t.name, t.engine, t.base_url, t.model) for t in settings.targets], _now())
    calibrated = TokenCalibration()
    calibrated.note(1000, 1000)  # one byte, one token
    metrics = MonitorMetrics(CollectorRegistry())
    judge = TrafficJudge(settings, {"glm-prod": Answers(calibrated)}, MarkerBook(), metrics)

    state = ApiState(
        session_factory=session_factory, api_token=TOKEN, settings=settings,
        run_now=RunNow(_no_run, min_interval=0), health=lambda: {}, metrics_page=metrics.exposition,
        ingest_token=INGEST, traffic=HttpIngest(TrafficPipeline(judge, None, session_factory)),
    )  # fmt: skip
    with TestClient(build_http_app(state)) as c:
        yield c


async def _no_run(name: str) -> list[dict[str, Any]]:
    raise KeyError(name)


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def record(i: int, **fields: Any) -> dict[str, Any]:
    return {
        "id": f"req-{i}", "time": time.time(), "caller": f"team-{i % 3}", "caller_kind": "team",
        "api_base": BASE, "status": 200, "prompt": {"chars": 2000, "bytes": 2000, "messages": 1},
        "usage": {"prompt_tokens": 2010, "completion_tokens": 10}, **fields,
    }  # fmt: skip


def post(client: TestClient, records: list[dict[str, Any]], token: str = INGEST, **body: Any) -> Any:
    return client.post(
        "/api/v1/traffic", json={"version": VERSION, "gateway": "gw-1", "records": records, **body},
        headers={"Authorization": f"Bearer {token}"},
    )  # fmt: skip


@pytest.mark.parametrize(
    "base", [BASE, BASE + "/", BASE.upper().replace("HTTP://", "http://"), "HTTP://127.0.0.1:30000/V1/"]
)
def test_a_record_is_routed_whatever_the_case_of_its_host_and_v1(client: TestClient, base: str) -> None:
    assert post(client, [record(1, api_base=base)]).json()["accepted"] == 1


def test_the_ingest_token_posts_traffic_and_reads_nothing(client: TestClient) -> None:
    assert post(client, [record(1)]).json() == {
        "accepted": 1,
        "unmatched": 0,
        "own": 0,
        "flagged": 0,
        "rejected": 0,
        "duplicates": 0,
    }
    assert post(client, [record(2)], token=TOKEN).status_code == 200
    assert post(client, [record(3)], token="kvc-wrong-token-0123456789").status_code == 401
    for path in ("/api/v1/traffic", "/api/v1/incidents", "/api/v1/probe-results"):
        assert client.get(path, headers={"Authorization": f"Bearer {INGEST}"}).status_code == 401


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"caller": "x" * 201}, "caller"),
        ({"caller": "evil\x00"}, "caller"),
        ({"status": 99}, "status"),
        ({"fingerprints": {"prompt": [2**53]}}, "prompt"),
        ({"fingerprints": {"response": list(range(1025))}}, "response"),
        ({"distinctive": {"prompt": [0]}}, "distinctive"),  # 0 is no token's print
        ({"distinctive": {"response": list(range(1, 258))}}, "distinctive"),  # 256 a side
        ({"markers": ["not a marker"]}, "markers"),
        ({"usage": {"prompt_tokens": -1}}, "prompt_tokens"),
        ({"prompt": {"chars": "many"}}, "chars"),
        ({"text": "a customer's words"}, "text"),  # a record never carries text
        ({"key_hash": "sk-a-raw-key-0123"}, "key_hash"),  # a digest or nothing, never a key
    ],
)
def test_a_bad_record_is_422_naming_the_field_and_costs_none_of_the_others(
    client: TestClient, session_factory: Factory, change: dict[str, Any], field: str
) -> None:
    over = record(1, usage={"prompt_tokens": 1})  # flagged: kept
    answer = post(client, [over, record(2, **change)])
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert any(e["loc"][:2] == ["records", 1] and field in map(str, e["loc"]) for e in body["detail"]), body
    assert (body["accepted"], body["flagged"], body["rejected"]) == (1, 1, 1)
    with session_factory() as s:
        assert s.scalars(select(TrafficRecordRow.request_id)).all() == ["req-1"]
        assert s.scalar(select(func.count()).select_from(TrafficMinute)) == 1
    assert "a customer's words" not in answer.text  # a refusal never echoes what was sent


def test_a_record_that_is_not_an_object_costs_only_itself(client: TestClient) -> None:
    answer = post(client, [record(1, usage={"prompt_tokens": 1}), None, "a string"])  # type: ignore[list-item]
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert {tuple(e["loc"][:2]) for e in body["detail"]} == {("records", 1), ("records", 2)}, body
    assert (body["accepted"], body["flagged"], body["rejected"]) == (1, 1, 2)


def test_a_batch_sent_again_is_judged_once(client: TestClient, session_factory: Factory) -> None:
    """Judged once by its records' ids: the resend's answer says they were judged already."""
    over = record(1, usage={"prompt_tokens": 1})
    first = post(client, [over], batch="ab" * 16)
    assert (first.json()["accepted"], first.json()["flagged"], first.json()["duplicates"]) == (1, 1, 0)
    again = post(client, [over], batch="ab" * 16).json()
    assert (again["accepted"], again["flagged"], again["duplicates"]) == (0, 0, 1)
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(TrafficRecordRow)) == 1
        assert s.scalar(select(func.sum(TrafficMinute.records))) == 1


def test_a_probe_marker_in_a_customer_answer_is_a_leak_and_the_monitors_own_traffic_is_not_judged(
    client: TestClient,
) -> None:
    judge = client.app.state.api.traffic.judge  # type: ignore[attr-defined]
    _, marker = judge.markers.plant("glm-prod", "alice")
    own_key = "kvc-test-key-alice-0001"
    judge.own_keys = frozenset({hashlib.sha256(own_key.encode()).hexdigest()})
    mine = record(2, markers=[marker], key_hash=hashlib.sha256(own_key.encode()).hexdigest())
    answer = post(client, [record(1, markers=[marker, "KVC-00000000-" + "0" * 32]), mine]).json()
    assert (answer["accepted"], answer["own"], answer["flagged"]) == (1, 1, 1)
    kept = client.get(
        "/api/v1/traffic", params={"check": "marker"}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    (leak,) = kept.json()["items"]
    assert leak["verdict"] == "leak" and leak["request_id"] == "req-1"
    (found,) = leak["findings"]["marker"]["markers"]
    assert found["owner_tenant"] == "alice" and marker not in kept.text  # ids and hashes, not the secret


def test_malformed_and_oversized_bodies_are_refused(client: TestClient) -> None:
    auth = {"Authorization": f"Bearer {INGEST}", "Content-Type": "application/json"}
    assert client.post("/api/v1/traffic", content=b"{not json", headers=auth).status_code == 422
    assert client.post("/api/v1/traffic", content=b"[]", headers=auth).status_code == 422
    big = json.dumps({"records": [], "pad": "x" * MAX_BODY_BYTES}).encode()
    assert client.post("/api/v1/traffic", content=big, headers=auth).status_code == 413
    assert post(client, [record(i) for i in range(MAX_RECORDS + 1)]).status_code == 422


def test_every_status_the_ingest_answers_is_in_its_openapi_document_with_its_body(
    client: TestClient, session_factory: Factory
) -> None:
    auth = {"Authorization": f"Bearer {INGEST}", "Content-Type": "application/json"}
    answers = [
        post(client, [record(1)]),
        post(client, [record(2)], token="kvc-wrong-token-0123456789"),
        client.post("/api/v1/traffic", content=b"{not json", headers=auth),
        post(client, [record(3), record(4, status=99)]),  # one record refused, the other judged
        client.post("/api/v1/traffic", content=b" " * (MAX_BODY_BYTES + 1), headers=auth),
    ]
    settings = settings_with_targets()
    off = ApiState(
        session_factory=session_factory, api_token=TOKEN, settings=settings,
        run_now=RunNow(_no_run, min_interval=0), health=lambda: {}, metrics_page=lambda: b"",
        ingest_token=INGEST, traffic=None,
    )  # fmt: skip
    with TestClient(build_http_app(off)) as not_judging:
        answers.append(post(not_judging, [record(5)]))
    assert [a.status_code for a in answers] == [200, 401, 422, 422, 413, 503]
    documented = client.get("/openapi.json").json()
    declared = documented["paths"]["/api/v1/traffic"]["post"]["responses"]
    models = {"IngestOut": IngestOut, "IngestRefusal": IngestRefusal, "Problem": Problem}
    for answer in answers:
        schema = declared[str(answer.status_code)]["content"]["application/json"]["schema"]
        model = models[schema["$ref"].rsplit("/", 1)[1]]
        model.model_validate(answer.json(), strict=True)  # every key the model's, of its type
        assert set(answer.json()) <= set(model.model_fields), answer.json()


def test_flagged_and_near_pool_records_are_kept_and_listed_by_check_and_caller(client: TestClient) -> None:
    records = [
        record(1),  # 2,000 tokens of a 4,096 pool: passes, not kept
        record(2, prompt={"chars": 3900, "bytes": 3900}, usage={"prompt_tokens": 3905}),  # near the pool
        record(3, prompt={"chars": 9000, "bytes": 9000}, usage={"prompt_tokens": 1}),  # the incident
        record(4, api_base="http://10.0.0.9:8000/v1"),  # no target's
    ]
    assert post(client, records).json() == {
        "accepted": 3,
        "unmatched": 1,
        "own": 0,
        "flagged": 1,
        "rejected": 0,
        "duplicates": 0,
    }
    auth = {"Authorization": f"Bearer {TOKEN}"}
    kept = client.get("/api/v1/traffic", headers=auth).json()["items"]
    assert sorted(r["request_id"] for r in kept) == ["req-2", "req-3"]
    over = client.get("/api/v1/traffic", params={"check": "capacity"}, headers=auth).json()["items"]
    assert [r["request_id"] for r in over] == ["req-3"]
    assert over[0]["checks"] == ["tokens", "capacity"] and over[0]["kv_pool_tokens"] == 4096
    assert over[0]["findings"]["tokens"]["prompt_tokens"] == 1
    mine = client.get("/api/v1/traffic", params={"caller": "team-2", "limit": 1}, headers=auth).json()
    assert [r["request_id"] for r in mine["items"]] == ["req-2"]
    assert client.get("/api/v1/traffic", params={"check": "nope"}, headers=auth).status_code == 422


def test_a_refused_request_is_kept_and_counted_as_refused_and_is_no_incident(
    client: TestClient, session_factory: Factory
) -> None:
    over = {"chars": 9000, "bytes": 9000, "messages": 1}  # over the 4,096 pool: never judged as served
    prints = {"prompt": list(range(5, 13)), "response": []}
    records = [
        record(1, status=400, prompt=over, usage={}, fingerprints=prints,
               refused={"by": "admission", "tokens": 9016, "kv_pool_tokens": 4096}),
        record(2, status=503, refused={"by": "quarantine", "incident_id": 7}),
    ]  # fmt: skip
    answer = post(client, records).json()
    assert (answer["accepted"], answer["flagged"]) == (2, 0)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    kept = client.get("/api/v1/traffic", params={"verdict": "refused"}, headers=auth).json()["items"]
    by_id = {r["request_id"]: r for r in kept}
    assert set(by_id) == {"req-1", "req-2"}
    assert by_id["req-1"]["findings"] == {
        "refused": {"by": "admission", "tokens": 9016, "kv_pool_tokens": 4096, "incident_id": None}
    }
    assert by_id["req-1"]["checks"] == [] and by_id["req-1"]["status_code"] == 400
    assert by_id["req-2"]["findings"]["refused"]["incident_id"] == 7
    metrics = client.app.state.api.traffic.judge.metrics  # type: ignore[attr-defined]
    assert metrics.traffic_refused.labels("glm-prod", "admission")._value.get() == 1
    assert metrics.traffic_refused.labels("glm-prod", "quarantine")._value.get() == 1
    # No check judged them: no result of any traffic check, so nothing to open an incident with.
    assert not [s for s in metrics.traffic_records.collect()[0].samples if s.value]
    with session_factory() as s:
        minutes = s.scalars(select(TrafficMinute)).all()
    assert sum(m.records for m in minutes) == 2 and sum(m.answered for m in minutes) == 0
    # A refused record is never an answer: one that says it was 2xx is refused, naming the field.
    bad = post(client, [record(4, status=200, refused={"by": "admission"})])
    assert bad.status_code == 422 and "refused" in bad.text
    # A group refused wholesale: every refusal counted, the first ROWS_PER_MINUTE of a
    # caller's a minute kept as rows.
    burst = [record(100 + i, caller="acme", status=503, refused={"by": "quarantine"}) for i in range(30)]
    assert post(client, burst).json()["accepted"] == 30
    assert metrics.traffic_refused.labels("glm-prod", "quarantine")._value.get() == 31
    kept_acme = client.get("/api/v1/traffic", params={"verdict": "refused", "caller": "acme"}, headers=auth)
    assert len(kept_acme.json()["items"]) == ROWS_PER_MINUTE
    # The prompt's prints joined no window: the same text answered to another caller is no leak.
    echo = record(3, caller="initech", fingerprints={"prompt": [99], "response": list(range(5, 13))})
    assert post(client, [echo]).json()["flagged"] == 0


def test_a_reworded_leak_is_kept_and_listed_under_its_check_with_counts_never_tokens(
    client: TestClient,
) -> None:
    notes = list(range(101, 121))  # one caller's prompt: twenty distinctive tokens' prints
    records = [
        record(1, caller="acme", distinctive={"prompt": notes, "response": [7]}),
        record(2, caller="initech", distinctive={"prompt": [9], "response": [102, 105, 111, 8]}),
    ]
    assert post(client, records).json()["flagged"] == 1
    auth = {"Authorization": f"Bearer {TOKEN}"}
    (kept,) = client.get("/api/v1/traffic", params={"check": "reworded"}, headers=auth).json()["items"]
    assert kept["request_id"] == "req-2" and kept["caller"] == "initech"
    found = {k: v for k, v in kept["findings"]["reworded"].items() if k not in ("verdict", "reason")}
    assert kept["findings"]["reworded"]["reason"] == "another_callers_tokens"
    assert found == {"shared_tokens": 3, "response_tokens": 4, "other_caller": "acme"}


def test_kept_records_and_minute_counts_are_pruned_a_batch_at_a_time(
    client: TestClient, session_factory: Factory
) -> None:
    from datetime import timedelta
    from functools import partial

    from kvcanary.monitor.storage.retention import in_batches
    from kvcanary.monitor.storage.traffic_rows import prune_traffic

    over = [record(i, prompt={"chars": 9000, "bytes": 9000}, usage={"prompt_tokens": 1}) for i in range(3)]
    assert post(client, over).json()["flagged"] == 3
    step = partial(prune_traffic, minute_days=1)
    assert in_batches(session_factory, step) == 0  # nothing is due yet
    with session_factory() as s, s.begin():
        assert prune_traffic(s, now=_now() + timedelta(days=400), batch=2, minute_days=1) == 2
    with session_factory() as s, s.begin():
        # the last record, and the three callers' minute rows
        assert prune_traffic(s, now=_now() + timedelta(days=400), minute_days=1) == 1 + 3
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(TrafficRecordRow)) == 0
        assert s.scalar(select(func.count()).select_from(TrafficMinute)) == 0
