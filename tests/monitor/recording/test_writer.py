"""Group commit: many verdicts to a transaction, bad news never held back, nothing lost on close."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.recording import writer as writer_module
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.recording.spool import Spool
from kvcanary.monitor.recording.writer import BatchWriter
from kvcanary.monitor.storage.models import Incident, ProbeResultRow
from kvcanary.probes.base import ProbeResult, Verdict
from tests.monitor.recording.test_recorder import settings_for
from tests.support.monitor_db import T0

Factory = sessionmaker[Session]


class CountingRecorder(Recorder):
    """A real recorder that also notes the size of each transaction it was handed."""

    batches: list[list[str]]

    def record_many(self, items: list[PendingResult]) -> list:  # type: ignore[type-arg]
        self.batches.append([item.result.verdict for item in items])
        return super().record_many(items)


def writer_for(
    session_factory: Factory, linger_seconds: float = writer_module.LINGER_SECONDS
) -> tuple[BatchWriter, CountingRecorder]:
    config = settings_for()
    recorder = CountingRecorder(config, session_factory, Spool(None))
    recorder.batches = []
    return BatchWriter(recorder, linger_seconds), recorder


async def submit_all(writer: BatchWriter, verdicts: list[str]) -> list:  # type: ignore[type-arg]
    target = writer.recorder.settings.targets[0]
    runs = [
        writer.submit(
            PendingResult.of(
                target, f"probe{i}", ProbeResult(Verdict(v), "r"), T0 + timedelta(seconds=i), 0.1
            )
        )
        for i, v in enumerate(verdicts)
    ]
    return list(await asyncio.gather(*runs))


def test_passes_arriving_together_share_one_transaction(session_factory: Factory) -> None:
    writer, recorder = writer_for(session_factory)
    try:
        outcomes = asyncio.run(submit_all(writer, ["pass"] * 12))
    finally:
        writer.close()
    assert all(o is not None for o in outcomes)
    assert [len(b) for b in recorder.batches] == [12]
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(ProbeResultRow)) == 12


def test_a_leak_is_written_at_once_whatever_the_linger(
    session_factory: Factory,
) -> None:
    """With passes lingering for a minute, a leak must still be recorded (and its incident open) now."""
    writer, recorder = writer_for(session_factory, linger_seconds=60.0)

    async def scenario() -> list:  # type: ignore[type-arg]
        return await asyncio.wait_for(submit_all(writer, ["pass", "pass", "leak"]), timeout=20)

    try:
        outcomes = asyncio.run(scenario())
    finally:
        writer.close()
    assert outcomes[2] is not None and outcomes[2].change == "opened"
    assert sum(len(b) for b in recorder.batches) == 3
    with session_factory() as s:
        assert s.scalars(select(Incident.severity)).all() == ["critical"]


def test_close_records_what_is_still_waiting(
    session_factory: Factory,
) -> None:
    writer, _ = writer_for(session_factory, linger_seconds=60.0)

    async def scenario() -> None:
        runs = asyncio.ensure_future(submit_all(writer, ["pass"] * 5))
        await asyncio.sleep(0.5)  # the passes linger, waiting for company
        await asyncio.to_thread(writer.close)
        await asyncio.wait_for(runs, timeout=20)

    asyncio.run(scenario())
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(ProbeResultRow)) == 5


def test_a_result_queued_without_waiting_is_recorded_before_close(session_factory: Factory) -> None:
    """What a cancelled run found is queued with ``enqueue`` (nothing can await it) and still lands."""
    writer, _ = writer_for(session_factory)
    target = writer.recorder.settings.targets[0]
    writer.enqueue(pending(target, ProbeResult(Verdict.LEAK, "foreign_marker"), T0))
    writer.close()
    with session_factory() as s:
        assert s.scalars(select(ProbeResultRow.verdict)).all() == ["leak"]
        assert s.scalars(select(Incident.severity)).all() == ["critical"]


def test_close_spools_what_a_hung_database_holds_back(db_engine: Engine, session_factory: Factory) -> None:
    """A database that neither answers nor fails (a table lock held elsewhere) holds the writer's
    thread: close() must give up after its timeout and put what is still queued in the spool."""
    if db_engine.dialect.name != "postgresql":
        pytest.skip("SQLite's busy timeout turns a lock into an error (spooled by the recorder), not a hang")
    writer, recorder = writer_for(session_factory)
    target = recorder.settings.targets[0]
    with db_engine.connect() as blocker:
        blocker.exec_driver_sql("LOCK TABLE probe_result IN ACCESS EXCLUSIVE MODE")
        writer.enqueue(pending(target, ProbeResult(Verdict.MISMATCH, "nonce_missing"), T0))
        wait_for_a_blocked_statement(db_engine)  # the writer's thread now hangs on the lock
        for i in range(3):
            later = T0 + timedelta(seconds=i + 1)
            writer.enqueue(pending(target, ProbeResult(Verdict.LEAK, "foreign_marker"), later))
        assert writer.close(timeout=2.0) == 3
        assert len(recorder.spool) == 3 and recorder.spool.head().result.verdict == "leak"  # type: ignore[union-attr]
        blocker.rollback()  # the lock goes: the hung batch completes on its own
    writer._thread.join(10)
    recorder.replay()
    with session_factory() as s:
        assert sorted(s.scalars(select(ProbeResultRow.verdict)).all()) == ["leak", "leak", "leak", "mismatch"]


def wait_for_a_blocked_statement(engine: Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            if conn.exec_driver_sql("SELECT count(*) FROM pg_locks WHERE NOT granted").scalar():
                return
        time.sleep(0.05)
    raise AssertionError("no statement ever waited on the lock")


def pending(target: TargetConfig, outcome: ProbeResult, started_at: datetime) -> PendingResult:
    return PendingResult.of(target, "cross_tenant", outcome, started_at, 1.0, started_at, "")
