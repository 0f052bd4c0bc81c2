"""The runner and the scheduler: one run per (target, probe) at a time, errors never leak."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings, parse_settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.recording.result_writer import NotRecorded
from kvcanary.monitor.recording.spool import Spool
from kvcanary.monitor.recording.writer import BatchWriter
from kvcanary.monitor.runs.runner import ProbeRunner, RunSummary
from kvcanary.monitor.runs.scheduler import assign, build_scheduler, next_in_phase, run_now
from kvcanary.monitor.storage.db import make_engine, make_session_factory
from kvcanary.monitor.storage.models import Incident, ProbeResultRow
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import Call, FakeEngine, answer, loopback_target
from tests.support import WorkerProcess, free_port

T = TypeVar("T")


def settings_for(url: str, **target: object) -> Settings:
    return parse_settings(
        {
            "scheduler": {"max_concurrency": 2},
            "targets": [
                {
                    "name": "t",
                    "base_url": url,
                    "engine": "reference",
                    "model": "kvcanary-reference",
                    "tenants": [{"name": "a"}, {"name": "b"}],
                    "timeout_seconds": 10,
                    **target,
                }
            ],
        }
    )


def runner_for(settings: Settings, summaries: list[RunSummary] | None = None) -> ProbeRunner:
    clients = {t.name: OpenAIHttpTarget(t, {tn.name: None for tn in t.tenants}) for t in settings.targets}
    metrics = MonitorMetrics(CollectorRegistry())
    return ProbeRunner(
        settings,
        clients,
        MarkerBook(),
        metrics,
        NotRecorded(),
        summaries.append if summaries is not None else None,
    )


def run_and_close(runner: ProbeRunner, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` on a new event loop, then close the runner's HTTP clients on that loop: a
    session left open warns when it is collected, in whichever test runs then."""

    async def then_close() -> T:
        try:
            return await work
        finally:
            for client in runner.clients.values():
                await runner.close_when_idle(client)

    return asyncio.run(then_close())


def test_two_runs_of_one_target_and_probe_never_overlap(start_worker: Callable[..., WorkerProcess]) -> None:
    worker = start_worker("--mode", "aggregated")
    summaries: list[RunSummary] = []
    runner = runner_for(settings_for(worker.url, probes=["canary"]), summaries)

    async def both() -> None:
        await asyncio.gather(runner.run("t", "canary"), runner.run("t", "canary"))

    run_and_close(runner, both())
    first, second = sorted(summaries, key=lambda s: s.started_at)
    assert first.result.verdict is Verdict.PASS and second.result.verdict is Verdict.PASS
    assert second.started_at >= first.started_at + timedelta(seconds=first.duration_seconds * 0.99)


def test_an_unreachable_target_is_an_error_counted_in_metrics_never_a_leak() -> None:
    settings = settings_for(f"http://127.0.0.1:{free_port()}")
    runner = runner_for(settings)
    results = run_and_close(runner, runner.run_target("t"))
    assert {r["verdict"] for r in results} == {"error"}
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(runner.metrics.registry).decode())
    }
    runs = {
        (s.labels["probe"], s.labels["verdict"]): s.value
        for s in families["kvcanary_probe_runs"].samples
        if s.name == "kvcanary_probe_runs_total"
    }
    assert runs[("canary", "error")] == 1
    assert runs[("canary", "leak")] == 0, "known series are exported as zeros"
    leaks = [s for s in families["kvcanary_cross_tenant_leaks"].samples if s.name.endswith("_total")]
    assert [s.value for s in leaks] == [0]


def test_an_unknown_target_or_probe_is_a_key_error() -> None:
    runner = runner_for(settings_for("http://127.0.0.1:1", probes=["canary"]))
    with pytest.raises(KeyError):
        asyncio.run(runner.run("nope", "canary"))
    with pytest.raises(KeyError):
        asyncio.run(runner.run("t", "boundary"))


def test_the_scheduler_has_one_non_overlapping_job_per_target_and_probe() -> None:
    settings = settings_for("http://127.0.0.1:1", interval_seconds=7, probe_intervals={"boundary": 90})
    scheduler = build_scheduler(settings, runner_for(settings))
    jobs = {job.id: job for job in scheduler.get_jobs()}
    # The defaults: three kinds that judge answers, and the three audits that send no request.
    kinds = ("canary", "cross_tenant", "boundary", "capacity", "version", "counters")
    assert set(jobs) == {f"probe:t:{kind}" for kind in kinds}
    for job in jobs.values():
        assert job.max_instances == 1 and job.coalesce is True
    assert jobs["probe:t:boundary"].trigger.interval == timedelta(seconds=90)
    assert jobs["probe:t:canary"].trigger.interval == timedelta(seconds=7)
    assert jobs["probe:t:canary"].trigger.jitter


def test_a_replica_keeps_paused_the_jobs_it_does_not_own_and_resumes_them_in_phase() -> None:
    settings = settings_for("http://127.0.0.1:1", interval_seconds=7, probe_intervals={"boundary": 90})
    scheduler = build_scheduler(settings, runner_for(settings), owns=lambda target, kind: kind != "boundary")
    jobs = {job.id: job for job in scheduler.get_jobs()}
    assert jobs["probe:t:boundary"].next_run_time is None
    assert jobs["probe:t:canary"].next_run_time is not None

    gained, lost = assign(scheduler, settings, lambda target, kind: kind == "boundary")
    others = [("t", kind) for kind in ("canary", "capacity", "counters", "cross_tenant", "version")]
    assert gained == [("t", "boundary")] and sorted(lost) == others
    assert assign(scheduler, settings, lambda target, kind: kind == "boundary") == ([], [])
    assert jobs["probe:t:canary"].next_run_time is None
    boundary = jobs["probe:t:boundary"]
    # Resumed at the next point of its own phase (start_date + k x interval, plus jitter), not now:
    # pairs a replica takes over keep their spread instead of firing in one burst.
    trigger = boundary.trigger
    now = datetime.now(UTC)
    steps = max(0, math.ceil((now - trigger.start_date) / trigger.interval))
    phase = trigger.start_date + steps * trigger.interval
    assert phase <= boundary.next_run_time <= phase + timedelta(seconds=trigger.jitter or 0)


def test_runs_skipped_while_the_last_still_runs_are_said_once_not_on_every_skip(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = settings_for("http://127.0.0.1:1")
    ran = []

    async def slow() -> None:  # a round on a slow database: six times its interval
        ran.append(time.monotonic())
        await asyncio.sleep(0.6)

    async def go() -> None:
        scheduler = build_scheduler(settings, runner, [("slow", slow, 0.1)], owns=lambda target, kind: False)
        scheduler.start()
        await asyncio.sleep(2.0)
        scheduler.shutdown(wait=False)

    runner = runner_for(settings)
    with caplog.at_level(logging.INFO):
        run_and_close(runner, go())
    said = [r.getMessage() for r in caplog.records if "was skipped" in r.getMessage()]
    theirs = [r for r in caplog.records if "maximum number of running instances" in r.getMessage()]
    assert len(ran) >= 2, ran  # it ran again once the last run ended
    assert len(said) == 1 and said[0].startswith("housekeeping:slow: a run was due"), said
    assert theirs == [], [r.getMessage() for r in theirs]  # APScheduler's line on every skip is gone


def test_a_leak_read_before_shutdown_cancels_the_run_is_still_recorded(
    session_factory: sessionmaker[Session],
) -> None:
    """SIGTERM's drain cancels a cross_tenant run stuck in its one-by-one round: the foreign marker its
    concurrent round already read must reach the database all the same."""
    engine = FakeEngine()
    released = False  # the hung requests end when the test is over, so that the server can close

    async def leaky_then_hung(call: Call) -> httpx.Response:
        # The concurrent round's reads get every marker sent so far (a cache shared across tenants);
        # from the fifth request on, the target stops answering.
        while len(engine.calls) > 4 and not released:
            await asyncio.sleep(0.02)
        if "reference codes" in call.prompt:
            return answer(call, "OK")
        return answer(call, " ".join(m for c in engine.calls for m in c.markers))

    engine.reply = leaky_then_hung
    settings = settings_for("http://engine.test", probes=["cross_tenant"])
    recorder = Recorder(settings, session_factory, Spool(None))
    writer = BatchWriter(recorder)

    async def scenario() -> int:
        client = loopback_target(settings.targets[0], {"a": None, "b": None}, engine)
        metrics = MonitorMetrics(CollectorRegistry())
        runner = ProbeRunner(settings, {"t": client}, MarkerBook(), metrics, writer)
        run = asyncio.ensure_future(runner.run("t", "cross_tenant"))
        while len(engine.calls) < 5:  # the concurrent round is over; the one-by-one round hangs
            await asyncio.sleep(0.01)
        cancelled = await runner.drain(0.1)
        assert run.cancelled()
        nonlocal released
        released = True
        await client.aclose()
        return cancelled

    try:
        assert asyncio.run(scenario()) == 1
    finally:
        writer.close()
    with session_factory() as s:
        row = s.execute(select(ProbeResultRow.verdict, ProbeResultRow.reason, ProbeResultRow.detail)).one()
        assert (row.verdict, row.reason) == ("leak", "foreign_marker"), row.detail
        assert s.scalars(select(Incident.severity)).all() == ["critical"]


class LoadCountingRecorder(Recorder):
    loads = 0

    def load_state(self, target: str, probe: str, node: str) -> dict[str, object] | None:
        self.loads += 1
        return super().load_state(target, probe, node)


def test_a_state_the_database_could_not_read_is_neither_kept_nor_overwritten(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """A database away when a pair's state is first needed is not an empty state: the next run asks
    again, and what a run from nothing leaves is not stored over the real one (a replay baseline)."""
    worker = start_worker("--mode", "aggregated")
    settings = settings_for(worker.url, probes=["canary"])
    away = make_session_factory(make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none"))
    recorder = LoadCountingRecorder(settings, away, Spool(None))
    summaries: list[RunSummary] = []
    clients = {"t": OpenAIHttpTarget(settings.targets[0], {"a": None, "b": None})}
    metrics = MonitorMetrics(CollectorRegistry())
    writer = BatchWriter(recorder)
    runner = ProbeRunner(settings, clients, MarkerBook(), metrics, writer, summaries.append)

    async def twice() -> None:
        await runner.run("t", "canary")
        await runner.run("t", "canary")
        await clients["t"].aclose()

    try:
        asyncio.run(twice())
    finally:
        writer.close()
    assert [s.result.verdict for s in summaries] == [Verdict.PASS, Verdict.PASS]
    assert recorder.loads == 2
    assert [s.result.state for s in summaries] == [None, None]
    assert len(recorder.spool) == 2  # the verdicts themselves wait in the spool


def test_every_replica_places_a_pairs_runs_at_the_same_moments() -> None:
    """Phases are counted from a fixed date, not from a process's start: a pair taken over by another
    replica (started at another time) runs when it would have run anyway."""
    settings = settings_for("http://127.0.0.1:1", interval_seconds=7, probe_intervals={"boundary": 90})
    exact = settings.scheduler.model_copy(update={"jitter_seconds": 0})
    settings = settings.model_copy(update={"scheduler": exact})
    first = {j.id: j.next_run_time for j in build_scheduler(settings, runner_for(settings)).get_jobs()}
    time.sleep(1.3)  # a replica that started later
    later = {j.id: j.next_run_time for j in build_scheduler(settings, runner_for(settings)).get_jobs()}
    for job_id, at in first.items():
        interval = settings.targets[0].interval_for(job_id.rsplit(":", 1)[1])  # capacity's own is longer
        apart = (later[job_id] - at).total_seconds()
        assert abs(apart - round(apart / interval) * interval) < 0.01, (job_id, apart)
    start = datetime(2026, 11, 30, 12, 0, 3, tzinfo=UTC)
    assert next_in_phase(start, 60, 0.5) == datetime(2026, 11, 30, 12, 0, 30, tzinfo=UTC)
    assert next_in_phase(start, 60, 0.0) == datetime(2026, 11, 30, 12, 1, 0, tzinfo=UTC)


def test_run_now_moves_only_this_replicas_jobs_and_the_runner_hears_when_each_was_due() -> None:
    settings = settings_for("http://127.0.0.1:1", interval_seconds=600)

    class Noting(ProbeRunner):
        due: list[tuple[str, str, datetime]] = []

        def note_due(self, target: str, kind: str, due: datetime) -> None:
            self.due.append((target, kind, due))

        async def run_scheduled(self, target_name: str, kind: str) -> list[RunSummary]:
            return []  # the clock is what is tested here, not a run

    base = runner_for(settings)
    runner = Noting(settings, base.clients, MarkerBook(), base.metrics, None, None)

    async def run() -> list[tuple[str, str, datetime]]:
        scheduler = build_scheduler(settings, runner, owns=lambda target, kind: kind != "boundary")
        scheduler.start()
        asked = datetime.now(UTC)
        run_now(scheduler, "t", ["canary", "boundary"])  # boundary is another replica's: paused
        deadline = time.monotonic() + 30
        while not runner.due and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        scheduler.shutdown(wait=False)
        assert all(due >= asked - timedelta(seconds=1) for _, _, due in runner.due)
        return runner.due

    assert [(t, k) for t, k, _ in asyncio.run(run())] == [("t", "canary")]


def test_a_node_whose_run_hangs_is_skipped_and_its_siblings_keep_their_cadence(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """A node that accepts connections and never answers (a decode node a gateway keeps retrying)
    holds its own run for a whole timeout; the clock's later firings skip it and run its sibling,
    each waiting no longer than the kind's interval."""
    worker = start_worker("--mode", "aggregated")
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # the kernel completes the handshake; nobody ever reads the request
    nodes = [{"name": "live", "info_url": worker.url},
             {"name": "hung", "info_url": f"http://127.0.0.1:{hung.getsockname()[1]}"}]  # fmt: skip
    # A firing waits up to one interval for its runs: the live node's run must fit in it on a loaded
    # machine (a run still going at the next firing is skipped, as it should be), and the hung one's
    # timeout must be far beyond it.
    interval, timeout = 2.0, 20
    settings = settings_for(
        worker.url,
        probes=["version"],
        nodes=nodes,
        timeout_seconds=timeout,
        probe_intervals={"version": interval},
    )
    summaries: list[RunSummary] = []
    runner = runner_for(settings, summaries)

    async def four_firings() -> list[float]:
        took = []
        for _ in range(4):
            began = time.monotonic()
            await runner.run_scheduled("t", "version")
            took.append(time.monotonic() - began)
            await asyncio.sleep(interval - min(took[-1], interval))
        await runner.drain(0.1)  # the hung node's run, cut
        return took

    try:
        took = run_and_close(runner, four_firings())
    finally:
        hung.close()
    assert max(took) < interval + 1, took  # never a timeout (20 s) held by the hung node
    ran = Counter(s.node for s in summaries)
    assert ran["live"] == 4 and ran["hung"] == 0, ran  # the hung one's single run never ended
