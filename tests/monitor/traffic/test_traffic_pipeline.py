"""One traffic pipeline, one exactly-once scheme: posted records are judged once by their record ids,
taken directly by one replica or published to the stream when one is configured; with replicas
and no stream a post is refused (503), so that the tap keeps its records.

The app is the service's own (``build_http_app``), the judge and the database real; the stream is
the machine's NATS. Exactly once is counted where it lands: the per-minute counts
(``traffic_minute.records``, which every judged record adds one to) and the judged ids.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.replicas import Membership
from kvcanary.monitor.runs.run_now import RunNow
from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.monitor.storage.models import TrafficJudged, TrafficMinute, TrafficRecordRow
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.ingest import HttpIngest, StreamPublisher
from kvcanary.monitor.traffic.jetstream import TrafficStream
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.pipeline import TrafficPipeline
from kvcanary.monitor.traffic.stream_setup import verify
from kvcanary.probes.markers import MarkerBook
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import summarize
from kvcanary.wire import VERSION
from tests.monitor.traffic.test_traffic_api import INGEST, TOKEN, Answers, _now, record
from tests.support.jetstream import KEY, StreamNames, counted, exchange, in_process, until
from tests.support.monitor_app import settings_with_targets

Factory = sessionmaker[Session]
AUTH = {"Authorization": f"Bearer {INGEST}"}


def app_state(factory: Factory, ingest: HttpIngest) -> ApiState:
    async def no_run(name: str) -> list[dict[str, Any]]:
        raise KeyError(name)

    metrics = ingest.judge.metrics
    return ApiState(
        session_factory=factory, api_token=TOKEN, settings=ingest.judge.settings,
        run_now=RunNow(no_run, min_interval=0), health=lambda: {}, metrics_page=metrics.exposition,
        ingest_token=INGEST, traffic=ingest, judge=ingest.judge,
    )  # fmt: skip


def pipeline_on(factory: Factory) -> TrafficPipeline:
    """The pipeline over ``factory``'s database, judging glm-prod (``tests/monitor/conftest.py``)."""
    settings = settings_with_targets()
    with factory.begin() as s:
        upsert_targets(s, [(t.name, t.engine, t.base_url, t.model) for t in settings.targets], _now())
        s.execute(delete(TrafficJudged))  # the shared tables' emptying leaves the judged ids
    calibrated = TokenCalibration()
    calibrated.note(1000, 1000)
    metrics = MonitorMetrics(CollectorRegistry())
    judge = TrafficJudge(settings, {"glm-prod": Answers(calibrated)}, MarkerBook(), metrics)
    return TrafficPipeline(judge, None, factory)


def judged(factory: Factory) -> tuple[int, int]:
    """(records counted per minute, judged ids kept)."""
    with factory() as s:
        minutes = s.scalar(select(func.coalesce(func.sum(TrafficMinute.records), 0)))
        return int(minutes or 0), int(s.scalar(select(func.count()).select_from(TrafficJudged)) or 0)


def batch(records: list[dict[str, Any]], batch_id: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"version": VERSION, "batch": batch_id or uuid.uuid4().hex, "gateway": "gw-1", "records": records,
            **fields}  # fmt: skip


# --- one replica, HTTP taken directly -------------------------------------------------------------


@pytest.fixture
def direct(session_factory: Factory) -> Iterator[TestClient]:
    with TestClient(
        build_http_app(app_state(session_factory, HttpIngest(pipeline_on(session_factory))))
    ) as c:
        yield c


def test_a_resend_is_judged_once_by_its_record_ids_even_under_another_batch_id(
    direct: TestClient, session_factory: Factory
) -> None:
    """A tap resends a batch whose answer was lost; a gateway restarted sends its records again in
    a batch of a new id: neither is judged again (the batch-id memory is gone: the ids decide)."""
    records = [record(i, usage={"prompt_tokens": 1}) for i in range(3)]  # flagged: kept rows
    first = direct.post("/api/v1/traffic", json=batch(records, "ab" * 16, dropped=5), headers=AUTH).json()
    again = direct.post("/api/v1/traffic", json=batch(records, "ab" * 16, dropped=5), headers=AUTH).json()
    later = direct.post("/api/v1/traffic", json=batch(records), headers=AUTH).json()
    assert (first["accepted"], first["flagged"], first["duplicates"]) == (3, 3, 0)
    assert (again["accepted"], again["duplicates"]) == (0, 3)
    assert (later["accepted"], later["duplicates"]) == (0, 3)
    assert judged(session_factory) == (3, 3)
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(TrafficRecordRow)) == 3
    exposition = direct.get("/metrics").text  # the drop report rode with the first record: once
    assert 'kvcanary_traffic_tap_dropped_records_total{gateway="gw-1"} 5.0' in exposition


def test_two_records_under_one_upstream_id_are_both_judged(
    direct: TestClient, session_factory: Factory
) -> None:
    """The engine's response id repeats; the record's own id is its identity."""
    same = [record(i, upstream_id="chatcmpl-fixed") for i in (1, 2)]
    answer = direct.post("/api/v1/traffic", json=batch(same), headers=AUTH).json()
    assert (answer["accepted"], answer["duplicates"]) == (2, 0)
    assert judged(session_factory) == (2, 2)


def test_a_resend_racing_its_first_send_is_judged_once(session_factory: Factory) -> None:
    """The tap timed out waiting for the answer and sent the batch again while the first send was
    still being judged: the second waits for the first's ids, then finds them judged."""
    app = build_http_app(app_state(session_factory, HttpIngest(pipeline_on(session_factory))))
    body = batch([record(i) for i in range(50)], "cd" * 16)

    async def race() -> list[dict[str, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://monitor") as client:
            answers = await asyncio.gather(
                *(client.post("/api/v1/traffic", json=body, headers=AUTH) for _ in range(3))
            )
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        return [a.json() for a in answers]

    answers = asyncio.run(race())
    assert sorted(a["accepted"] for a in answers) == [0, 0, 50]
    assert sorted(a["duplicates"] for a in answers) == [0, 50, 50]
    assert judged(session_factory) == (50, 50)


# --- replicas ---------------------------------------------------------------------------------------


def test_http_with_two_live_replicas_is_refused_naming_the_stream(postgres_url: str) -> None:
    """Two replicas on one database and no stream: a post would be judged where it lands, each
    deployment's window split in two; it is refused, and the tap keeps its records."""
    upgrade(postgres_url)
    engine = make_engine(postgres_url)
    factory = make_session_factory(engine)
    ours = Membership(factory, shared=True, url="http://127.0.0.1:1")
    other = Membership(factory, shared=True, url="http://127.0.0.1:2")
    try:
        other.heartbeat()
        ours.heartbeat()
        assert len(ours.live) == 2
        ingest = HttpIngest(pipeline_on(factory), ours)
        with TestClient(build_http_app(app_state(factory, ingest))) as client:
            answer = client.post("/api/v1/traffic", json=batch([record(1)]), headers=AUTH)
            assert answer.status_code == 503, answer.text
            assert "traffic.source: jetstream" in answer.text
            other.leave()
            ours.heartbeat()  # alone again: taken directly
            assert (
                client.post("/api/v1/traffic", json=batch([record(1)]), headers=AUTH).json()["accepted"] == 1
            )
        with factory() as s:
            assert s.scalar(select(func.count()).select_from(TrafficJudged)) == 1
    finally:
        other.leave()
        ours.leave()
        with factory.begin() as s:  # the session's database: no judged id left for the next test
            s.execute(delete(TrafficJudged))
        engine.dispose()


# --- HTTP through the stream -----------------------------------------------------------------------


@pytest.mark.external_service
def test_posted_records_go_through_the_stream_and_are_judged_once(
    tmp_path: Path, stream_names: StreamNames
) -> None:
    """With the stream configured a post is published as the tap's sink publishes (the answer comes
    once JetStream took it) and judged by the partition's consumer: a resend of the batch (the
    stream's duplicate window drops its messages) and the records again under a new batch id (the
    pipeline finds their ids) are judged no more."""
    cfg = stream_names.settings()
    factory, pipeline = in_process(tmp_path, cfg)
    fingerprints = Fingerprinter(KEY)
    records = [summarize(exchange(i), fingerprints) for i in range(20)]
    first = batch(records, dropped=2)

    async def run() -> tuple[list[dict[str, Any]], int, int]:
        await verify(cfg, None)
        stream = TrafficStream(cfg, pipeline, "replica-a", None)
        ingest = HttpIngest(pipeline, None, StreamPublisher(cfg, stream.connection))
        transport = httpx.ASGITransport(app=build_http_app(app_state(factory, ingest)))
        stream.start()
        try:
            await until("the stream connected", lambda: stream.connection() is not None)
            async with httpx.AsyncClient(transport=transport, base_url="http://monitor") as client:
                answers = []
                for body in (first, first, batch(records)):
                    answer = await client.post("/api/v1/traffic", json=body, headers=AUTH)
                    assert answer.status_code == 200, answer.text
                    answers.append(answer.json())
            await until("every record judged, and the copies found judged",
                        lambda: stream.judged >= 20 and stream.duplicates >= 20)  # fmt: skip
            await asyncio.sleep(0.5)  # a second judging would land meanwhile
        finally:
            await stream.stop()
        return answers, stream.judged, stream.duplicates

    answers, judged_by_stream, duplicates = asyncio.run(asyncio.wait_for(run(), 60))
    assert [a["accepted"] for a in answers] == [20, 20, 20]  # each taken by the stream
    assert (judged_by_stream, duplicates) == (20, 20)
    assert counted(factory) == (20, 20)
    exposition = pipeline.judge.metrics.exposition().decode()
    assert 'kvcanary_traffic_tap_dropped_records_total{gateway="gw-1"} 2.0' in exposition
