"""An engine that gives every response one id: two customers' responses under
one upstream id are both judged and both in the blast radius, over HTTP and over JetStream.

Engines and gateways repeat response ids (a fixed id on every stream, a counter that restarts with
the process). Exactly-once keyed on that id would acknowledge the second response as a duplicate
and never judge it: a leak in it missed, and the blast radius undercounted. The records here are
made by the real tap (``summarize``) from exchanges whose gateway id is the same, both prompts over
the node's pool and answered 200 (the leak's signature), inside an over-pool incident's window.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.blast.compute import BlastSources, as_csv, blast_radius, request_rows
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.storage.models import TrafficJudged, TrafficRecordRow
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.jetstream import TrafficStream
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.pipeline import TrafficPipeline
from kvcanary.monitor.traffic.stream_setup import verify
from kvcanary.probes.markers import MarkerBook
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize
from kvcanary.wire import VERSION
from tests.monitor.blast.test_blast_radius import (  # noqa: F401 (app: a fixture, used by name)
    BASE,
    NOW,
    OWN_HASH,
    POOL,
    Answers,
    app,
    auth,
    by_caller,
    capacity_incident,
)
from tests.support.jetstream import KEY, StreamNames, tap, until
from tests.support.monitor_app import settings_with_targets

Factory = sessionmaker[Session]
#: What the engine calls every response it gives.
FIXED_ID = "chatcmpl-fixed"
CUSTOMERS = ("acme", "globex")


def leaked_exchange(caller: str, minutes_ago: float) -> Exchange:
    """A customer's request over the pool, answered 200 with one prompt token counted (the leak),
    under the engine's one id, inside the capacity incident's window."""
    started = (NOW - timedelta(minutes=minutes_ago)).timestamp()
    prompt = f"{caller} asks about the warranty of a charger, " * 80  # about 3,800 characters
    return Exchange(FIXED_ID, started, caller, "team", BASE, prompt=prompt, response="Noted, thanks.",
                    prompt_tokens=1, completion_tokens=4, latency_seconds=0.5)  # fmt: skip


def exchanges() -> list[Exchange]:
    return [leaked_exchange(caller, 60 + i) for i, caller in enumerate(CUSTOMERS)]


def assert_both_kept_judged_and_counted(factory: Factory, incident: int) -> set[str]:
    """Both responses are kept rows under their own record ids with the engine's id as data, and
    the incident's blast radius counts and lists both, by the id the customers got. Return the
    record ids."""
    with factory() as s:
        rows = s.execute(select(TrafficRecordRow.request_id, TrafficRecordRow.upstream_id,
                                TrafficRecordRow.caller, TrafficRecordRow.verdict)).all()  # fmt: skip
        assert sorted(r.caller for r in rows) == sorted(CUSTOMERS), rows
        assert {r.upstream_id for r in rows} == {FIXED_ID} and len({r.request_id for r in rows}) == 2
        assert all(r.request_id.startswith("tap-") and r.verdict == "mismatch" for r in rows), rows
        sources = BlastSources(own_keys=frozenset({OWN_HASH}), chars_per_token=lambda _t: 1.0)
        radius = blast_radius(s, incident, settings_with_targets(), sources)
        assert radius is not None and radius.primary is not None
        assert {caller: n.responses for caller, n in radius.callers()} == dict.fromkeys(CUSTOMERS, 1)
        listed = request_rows(s, radius)
    assert sorted((rid, caller) for rid, caller, _ in listed) == [(FIXED_ID, c) for c in CUSTOMERS]
    assert as_csv(listed, radius).count(f"\n{FIXED_ID},") == 2
    return {r.request_id for r in rows}


def test_over_http_two_responses_under_one_upstream_id_are_both_judged_and_in_the_blast_radius(
    app: tuple[TestClient, TrafficJudge],  # noqa: F811 (the fixture imported above)
    session_factory: Factory,
) -> None:
    client, _ = app
    incident = capacity_incident(session_factory)
    fingerprints = Fingerprinter(KEY)
    for exchange in exchanges():  # a batch each, as a tap sends them a moment apart
        records = [summarize(exchange, fingerprints)]
        body = {"version": VERSION, "batch": uuid.uuid4().hex, "gateway": "gw", "records": records}
        answer = client.post("/api/v1/traffic", json=body, headers=auth())
        assert answer.status_code == 200 and answer.json()["accepted"] == 1, answer.text
    assert_both_kept_judged_and_counted(session_factory, incident)
    radius = client.get(f"/api/v1/incidents/{incident}/blast-radius", headers=auth()).json()
    assert by_caller(radius) == dict.fromkeys(CUSTOMERS, 1) and radius["affected_responses"] == 2
    listed = client.get("/api/v1/traffic", headers=auth()).json()["items"]
    assert [r["upstream_id"] for r in listed] == [FIXED_ID, FIXED_ID]


@pytest.mark.external_service
def test_over_jetstream_two_responses_under_one_upstream_id_are_both_judged_and_in_the_blast_radius(
    tmp_path: Path, stream_names: StreamNames, session_factory: Factory
) -> None:
    """The real tap publishes both to the machine's NATS; a monitor in process consumes them."""
    cfg = stream_names.settings()
    settings = settings_with_targets()
    with session_factory.begin() as s:
        upsert_targets(s, [(t.name, t.engine, t.base_url, t.model) for t in settings.targets],
                       datetime.now(UTC) - timedelta(days=1))  # fmt: skip
    incident = capacity_incident(session_factory)
    calibrated = TokenCalibration()
    calibrated.note(1000, 1000)
    metrics = MonitorMetrics(CollectorRegistry())
    judge = TrafficJudge(
        settings, {"glm-prod": Answers(calibrated, POOL)}, MarkerBook(), metrics, own_keys={OWN_HASH}
    )
    ingest = TrafficPipeline(judge, None, session_factory)

    async def run() -> dict[str, Any]:
        await verify(cfg, None)
        sender = tap(stream_names)
        for exchange in exchanges():
            sender.put(exchange)
        deadline = time.monotonic() + 30
        while sender.sent < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        sender.close()
        stream = TrafficStream(cfg, ingest, "replica-a", None)
        stream.start()
        try:
            await until("both records judged or skipped", lambda: stream.judged + stream.duplicates >= 2)
            await asyncio.sleep(0.5)  # a second judging of either would land meanwhile
        finally:
            await stream.stop()
        return {"judged": stream.judged, "duplicates": stream.duplicates}

    assert asyncio.run(asyncio.wait_for(run(), 60)) == {"judged": 2, "duplicates": 0}
    record_ids = assert_both_kept_judged_and_counted(session_factory, incident)
    with session_factory() as s:  # each judged once by its own id
        marks = s.scalars(select(TrafficJudged.record_id).where(TrafficJudged.record_id.in_(record_ids)))
        assert set(marks) == record_ids
