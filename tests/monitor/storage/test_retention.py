"""Retention of evidence: excerpts (perhaps another customer's text) go early, verdicts stay.

On SQLite and PostgreSQL, through the recording path the runner uses.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import parse_settings
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.recording.spool import Spool
from kvcanary.monitor.runs.scheduler import FIRST_HOUSEKEEPING_SECONDS, build_scheduler
from kvcanary.monitor.storage.models import ProbeResultRow
from kvcanary.monitor.storage.retention import prune_expired, purge_excerpts
from kvcanary.probes.base import ProbeResult, Verdict
from tests.support.monitor_db import T0

Factory = sessionmaker[Session]
LEAK_EVIDENCE = {
    "leaks": [{"marker_id": "0a1b2c3d", "marker_sha256": "f" * 64, "excerpt": "another customer's words"}],
    "tenants": [{"tenant": "a", "excerpt": "stale page text", "prompt_tokens_reported": 1}],
}


def recorder(factory: Factory, **config: object) -> Recorder:
    settings = parse_settings({"targets": [{"name": "glm", "base_url": "http://x", "tenants": [{"name": "a"}],
                                            "probes": ["canary"]}], **config})  # fmt: skip
    return Recorder(settings, factory, Spool(None))


def record_leak(rec: Recorder, at: datetime) -> int:
    leak = ProbeResult(Verdict.LEAK, "foreign_marker", "seen", json.loads(json.dumps(LEAK_EVIDENCE)))
    outcome = rec.record(PendingResult.of(rec.settings.targets[0], "canary", leak, at, 0.1))
    assert outcome is not None
    return outcome.result_id


def test_excerpts_are_purged_after_their_days_and_the_verdict_stays(session_factory: Factory) -> None:
    rec = recorder(session_factory, retention={"excerpt_days": 2})
    row_id = record_leak(rec, T0)
    with session_factory() as s, s.begin():
        assert purge_excerpts(s, now=T0 + timedelta(days=1)) == 0  # not due yet
        assert purge_excerpts(s, now=T0 + timedelta(days=2, seconds=1)) == 1
        assert purge_excerpts(s, now=T0 + timedelta(days=3)) == 0  # done once
    with session_factory() as s:
        row = s.get(ProbeResultRow, row_id)
        assert row is not None and row.verdict == "leak" and row.excerpts_until is None
        text = json.dumps(row.evidence)
        assert "another customer's words" not in text and "stale page text" not in text
        assert row.evidence["leaks"][0]["marker_id"] == "0a1b2c3d"  # what names the leak stays
        assert row.evidence["tenants"][0]["prompt_tokens_reported"] == 1
        assert row.evidence["leaks"][0]["excerpt"] is None
        assert row.evidence["excerpts_note"].startswith("excerpts purged on")


def test_with_excerpts_off_no_excerpt_is_ever_stored(session_factory: Factory) -> None:
    rec = recorder(session_factory, evidence={"excerpts": False})
    row_id = record_leak(rec, T0)
    with session_factory() as s:
        row = s.get(ProbeResultRow, row_id)
        assert row is not None and row.excerpts_until is None
        assert "another customer's words" not in json.dumps(row.evidence)
        assert row.evidence["leaks"][0]["marker_sha256"] == "f" * 64


def test_pruning_goes_in_batches_that_each_commit(session_factory: Factory) -> None:
    rec = recorder(session_factory, retention={"pass_days": 1})
    target = rec.settings.targets[0]
    for i in range(25):
        rec.record(
            PendingResult.of(
                target, "canary", ProbeResult(Verdict.PASS, "ok"), T0 + timedelta(seconds=i), 0.1
            )
        )
    later = T0 + timedelta(days=2)
    batches = []
    while True:
        with session_factory() as s, s.begin():
            done = prune_expired(s, now=later, batch=10)
        batches.append(done)
        if done < 10:
            break
    assert batches == [10, 10, 5]
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(ProbeResultRow)) == 0


def test_housekeeping_first_runs_soon_after_start_not_an_interval_later() -> None:
    settings = parse_settings({})

    async def noop() -> None:
        return None

    scheduler = build_scheduler(settings, None, housekeeping=[("prune", noop, 3600)])  # type: ignore[arg-type]
    (job,) = scheduler.get_jobs()
    assert job.next_run_time <= datetime.now(UTC) + timedelta(seconds=FIRST_HOUSEKEEPING_SECONDS + 1)
