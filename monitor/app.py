"""The composition root: the only place where settings, storage, targets, probes, the scheduler,
the REST API and the metrics are wired together.

``Monitor`` owns the long-lived parts; ``create_app`` serves them over HTTP and starts and stops
the scheduler with the app's lifespan, so SIGTERM to ``kvcanary serve`` drains cleanly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.config.secrets import (
    TenantKeys,
    alertmanager_headers,
    api_token,
    ingest_token,
    marker_key,
    tenant_keys,
)
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.containment import Containment, Verifier
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.paging.pager import Delivery, Pager, paging_health
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.port import RecordingPort
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.recording.spool import open_spool
from kvcanary.monitor.recording.writer import BatchWriter
from kvcanary.monitor.reloads import take_up_file, take_up_nodes
from kvcanary.monitor.runs.coverage import run_keys
from kvcanary.monitor.runs.discovery import DISCOVERY_TICK_SECONDS, GatewayDiscovery
from kvcanary.monitor.runs.replicas import HEARTBEAT_SECONDS, Membership
from kvcanary.monitor.runs.run_now import RunNow
from kvcanary.monitor.runs.runner import ProbeRunner, RunSummary
from kvcanary.monitor.runs.scheduler import (
    PRUNE_INTERVAL_SECONDS,
    REPLAY_INTERVAL_SECONDS,
    assign,
    build_scheduler,
    run_now,
)
from kvcanary.monitor.storage import outbox
from kvcanary.monitor.storage.db import check_migrated, make_engine, make_session_factory
from kvcanary.monitor.storage.incident_rows import open_incident_counts
from kvcanary.monitor.storage.retention import prune_round
from kvcanary.monitor.storage.sqlite_file import sqlite_file_of
from kvcanary.monitor.targets.http import HttpClient
from kvcanary.monitor.targets.openai_format import Limits
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.monitor.traffic.ingest import HttpIngest, StreamPublisher
from kvcanary.monitor.traffic.judge import TrafficJudge, own_key_digests
from kvcanary.monitor.traffic.pipeline import TrafficPipeline
from kvcanary.probes import REGISTRY
from kvcanary.probes.markers import MarkerBook

if TYPE_CHECKING:
    from kvcanary.monitor.otel import VerdictEvents
    from kvcanary.monitor.traffic.jetstream import TrafficStream

log = logging.getLogger("kvcanary")

#: How often a SQLite file is checked for having been deleted or replaced under the process.
FILE_CHECK_SECONDS = 2


class Monitor:
    """Everything ``kvcanary serve`` runs. Construction validates secrets and the database.

    Raises ``ConfigError`` for missing secrets and ``DatabaseNotMigrated`` for an old schema.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: MonitorMetrics | None = None,
        on_summary: Callable[[RunSummary], None] | None = None,
        config_path: Path | None = None,
    ):
        self.settings = settings
        #: The file SIGHUP and POST /-/reload read again (None: nothing to reload from).
        self.config_path = config_path
        #: Called with the new settings after each successful reload (the HTTP app's state).
        self.on_reload: list[Callable[[Settings], None]] = []
        self.token = api_token(settings)
        keys = tenant_keys(settings)
        #: What a reload compares: a rotated key file replaces the target's client.
        self.tenant_keys = keys
        self._reloading = asyncio.Lock()
        am_headers = alertmanager_headers(settings)
        self.engine = make_engine(settings.database_url)
        check_migrated(self.engine)
        self.sqlite = sqlite_file_of(settings.database_url)
        if self.sqlite is not None:
            self.sqlite.lock()  # raises DatabaseInUse: SQLite is one process
            self.sqlite.guard(self.engine)
        self.session_factory: sessionmaker[Session] = make_session_factory(self.engine)
        self.read_session_factory = make_session_factory(self.engine, read_only=True)
        self.metrics = metrics or MonitorMetrics()
        self.markers = MarkerBook(
            ttl_seconds=settings.marker_ttl_seconds, key=marker_key(settings, self.token)
        )
        limits = Limits(**settings.limits.model_dump())
        # One connection pool and TLS context for every target (not one per target). Runs in
        # overtime keep their connections: the pool must not become a first-come semaphore again.
        scheduler = settings.scheduler
        self.http = HttpClient(max(64, (scheduler.max_concurrency + scheduler.max_overtime_runs) * 4))
        self._limits = limits
        self.clients = {t.name: self.client_of(t, keys) for t in settings.targets}
        self.spool = open_spool(settings)
        self.metrics.watch_spool(self.spool)
        self.recorder = Recorder(settings, self.session_factory, self.spool)
        if self.sqlite is not None:
            self.recorder.health.file_check = self.sqlite.check
        self.metrics.watch_incidents(
            self._open_incident_counts, lambda: run_keys(self.settings), self.recorder.health
        )
        self.on_summary = on_summary
        self._stop_asked_at: float | None = None  # time.monotonic() of the signal; set: stopping
        self.writer = BatchWriter(self.recorder)
        # Opt-in: every verdict as an OpenTelemetry GenAI evaluation event (monitor/otel.py).
        self.events: VerdictEvents | None = None
        if settings.otel is not None:
            from kvcanary.monitor.otel import VerdictEvents, otlp_headers  # the SDK only when used

            self.events = VerdictEvents(
                settings.otel, self.metrics.otel_dropped, headers=otlp_headers(settings.otel)
            )
        # Probe runs and gateway traffic record through one port, which pages at once on a change.
        self.port = RecordingPort(
            self.writer, on_change=self._page_now, on_suspicion=self._verify,
            on_recorded=self.events.offer if self.events is not None else None,
        )  # fmt: skip
        self.runner = ProbeRunner(
            settings, self.clients, self.markers, self.metrics, self.port, self.on_summary
        )
        self.runner.on_config_change = self._reaudit
        shared = self.engine.dialect.name == "postgresql"
        self.membership = Membership(self.session_factory, shared=shared, url=settings.api.base_url)
        self.runner.owns = self.membership.owns
        self.ingest_token = ingest_token(settings)
        judge = TrafficJudge(settings, self.clients, self.markers, self.metrics, own_key_digests(keys))
        # One pipeline for posted and streamed records; posts are published to the stream if used.
        jetstream = settings.traffic.jetstream
        pipeline = TrafficPipeline(judge, self.port, self.session_factory, jetstream.partitions)
        self.stream: TrafficStream | None = None
        publisher = None
        if settings.traffic.source == "jetstream":
            from kvcanary.monitor.traffic.jetstream import TrafficStream  # nats-py only when used
            from kvcanary.monitor.traffic.stream_setup import nats_token

            self.stream = TrafficStream(jetstream, pipeline, self.membership.id, nats_token(jetstream))
            self.metrics.watch_stream(self.stream.report)
            publisher = StreamPublisher(jetstream, self.stream.connection)
        self.traffic = HttpIngest(pipeline, self.membership, publisher)
        self._beat()  # know the other replicas before the first run, not a heartbeat later
        self.recorder.ensure_targets(settings.targets)
        if (stored := self.recorder.load_states()) is not None:
            self.runner.preload_states(stored)
        self.metrics.watch_replicas(self._replica_counts)
        self.pager: Pager | None = None
        self._pager_task: asyncio.Task[None] | None = None
        if settings.alertmanagers:
            self.metrics.declare_alertmanagers(am_headers)
            self.metrics.watch_outbox(self._outbox_backlog)
            delivery = Delivery(am_headers, self.metrics, settings.alerting.timeout_seconds)
            self.pager = Pager(settings, self.session_factory, delivery, link_key=self.token)
        # What the gateways are told to do about each deployment (monitor/containment/): the
        # quarantines, the admission guards' facts and, on NATS, the bucket the taps watch.
        self.containment = Containment(
            self.session_factory, lambda: self.settings, self.clients, self.traffic.judge.facts,
            on_change=self._quarantine_changed,
            connection=self.stream.connection if self.stream is not None else None,
            # A suspected leak is verified at once by the probes that can prove it.
            verifier=Verifier(
                lambda: self.settings, self.runner.run, self.session_factory,
                self.metrics.suspicion_verifications,
            ),
        )  # fmt: skip
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once started
        self._guards_read: asyncio.Task[None] | None = None
        self.metrics.watch_containment(
            lambda: [t.name for t in self.settings.targets],
            lambda: [(q.target, q.enforced) for q in self.containment.known],
            self.containment.report,
        )
        # Nodes found from SGLang gateways (monitor/runs/discovery.py), taken up as a reload would.
        self.discovery = GatewayDiscovery(settings, self.http, limits)
        self.metrics.watch_gateways(
            lambda: self.discovery.health, lambda: self.discovery.circuits,
            lambda: self.discovery, lambda: self.traffic.judge.facts.untrusted,
        )  # fmt: skip
        self.scheduler = build_scheduler(
            settings,
            self.runner,
            housekeeping=[
                ("gateway-discovery", self.discover, DISCOVERY_TICK_SECONDS),
                *self.containment.jobs(),
                ("prune", self.prune, PRUNE_INTERVAL_SECONDS),
                ("replay", self.replay, REPLAY_INTERVAL_SECONDS),
                ("heartbeat", self.heartbeat, HEARTBEAT_SECONDS),
                *([("database-file", self.watch_database_file, FILE_CHECK_SECONDS)] if self.sqlite else []),
            ],
            owns=self.membership.owns,
        )

    def _page_now(self) -> None:
        if self.pager is not None:
            self.pager.nudge()  # an incident changed: page now, not at the next poll
        # and quarantine now: a gateway reads the set within a second of it changing
        self.containment.round_now()

    def _verify(self, item: PendingResult, incident_id: int) -> None:
        self.containment.suspect(item, incident_id)

    def _quarantine_changed(self) -> None:
        """A target's quarantine changed (called from a thread): its alerts say so now."""
        if self.pager is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.pager.resend_now)

    def _reaudit(self, target: TargetConfig, node: str) -> None:
        """A node's configuration changed: run the deployment audits now, not at their next interval,
        and let probes that size their prompts by the node's capacity read it again."""
        self.clients[target.name].forget_capacity()
        self.traffic.judge.facts.forget_pools(target.name)  # gateway records: judged by the new pool
        # The capacity audit that saw the change has just run; the kinds that say so run again now.
        due = [k for k in target.probes if REGISTRY[k].reaudit_on_config_change]
        run_now(self.scheduler, target.name, due)
        where = f"{target.name}@{node}" if node else target.name
        log.warning("configuration of %s changed: re-auditing %s now", where, ", ".join(due) or "nothing")

    def _outbox_backlog(self) -> tuple[int, float]:
        with self.read_session_factory() as session:
            return outbox.backlog(session, now=datetime.now(UTC))

    def _open_incident_counts(self) -> Iterable[tuple[str, str, str, str, str, int]]:
        with self.read_session_factory() as session:
            return list(open_incident_counts(session))

    async def prune(self) -> None:
        """Delete expired results and purge expired excerpts, a batch per transaction. While the
        database is away this round is skipped with one line (the next, an interval on, tries
        again): a traceback per round would only bury the outage's own log lines."""
        # Judged ids are needed while a record can still come again: twice the duplicate window.
        keep = 2 * self.settings.traffic.jetstream.duplicate_window_seconds
        days = self.settings.retention.failure_days
        try:
            removed, purged = await asyncio.to_thread(
                prune_round, self.session_factory, minute_days=days, judged_keep_seconds=keep
            )
        except SQLAlchemyError as exc:
            log.warning("pruning skipped: the database did not answer (%s)", type(exc).__name__)
            return
        if removed or purged:
            log.info("pruned %d expired probe results; purged the excerpts of %d", removed, purged)

    async def heartbeat(self) -> None:
        before = self.membership.live
        await asyncio.to_thread(self._beat)
        if self.membership.live != before:
            gained, lost = assign(self.scheduler, self.settings, self.membership.owns)
            self.runner.forget_states(gained)
            log.info("replicas changed: %d probe jobs taken up, %d handed over", len(gained), len(lost))

    def _beat(self) -> None:
        try:
            self.membership.heartbeat()
        except Exception as exc:  # the database is away: keep the last view of the replicas
            log.warning("replica heartbeat failed (%s); keeping the last view", type(exc).__name__)

    def _replica_counts(self) -> tuple[int, int]:
        owned = sum(self.membership.owns(t.name, k) for t in self.settings.targets for k in t.probes)
        return len(self.membership.live), owned

    async def watch_database_file(self) -> None:
        """Notice a SQLite file deleted or replaced under the process: save what it held, spool the rest."""
        if self.sqlite is not None:
            await asyncio.to_thread(self.sqlite.take_over_if_lost, self.recorder.health, self.engine)

    async def replay(self) -> None:
        if len(self.spool):
            await asyncio.to_thread(self.recorder.replay)

    def health(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "scheduler": "running" if self.scheduler.running else "stopped",
            "targets": len(self.clients),
            "spooled_results": len(self.spool),
            "writes": self.recorder.health.report(),
        }
        if self.pager is not None:
            report["alerting"] = paging_health(
                self._outbox_backlog, self.settings.alerting.resend_interval_seconds
            )
        if self.stream is not None:
            report["traffic_stream"] = self.stream.report()
        return report

    def client_of(self, target: TargetConfig, keys: TenantKeys) -> OpenAIHttpTarget:
        tenants = {tn.name: keys[(target.name, tn.name)] for tn in target.tenants}
        worker = keys.workers.get(target.name)
        return OpenAIHttpTarget(target, tenants, limits=self._limits, client=self.http, worker_key=worker)

    async def reload(self, why: str) -> str | None:
        """Read the config file again and take it up; return None, or why it was refused (logged,
        and the settings in force stay): ``monitor/reloads.py``."""
        async with self._reloading:  # a SIGHUP and a POST at once: one after the other, in order
            return await take_up_file(self, why)

    async def discover(self) -> None:
        """Read the SGLang gateways that are due; a change of their nodes is taken up as a reload."""
        changes = await self.discovery.refresh()
        if changes:
            async with self._reloading:
                # Counted under the lock, for targets still configured: a reload that removed one
                # while its gateway was read has dropped its series, not to be made again.
                for target, change in changes.items():
                    if self.discovery.configured.target(target) is not None:
                        self.metrics.gateway_node_changes.labels(target, "joined").inc(len(change.joined))
                        self.metrics.gateway_node_changes.labels(target, "left").inc(len(change.left))
                await take_up_nodes(self)

    def start(self) -> None:
        if self._stop_asked_at is not None:  # SIGTERM came during start-up: start nothing
            return
        self._loop = asyncio.get_running_loop()
        if not self.scheduler.running:
            self.scheduler.start()
        if self.pager is not None and self._pager_task is None:
            self._pager_task = asyncio.get_running_loop().create_task(self.pager.run_forever())
        if self.stream is not None:
            self.stream.start()
        if self.events is not None:
            self.events.start()
        self._guards_read = self.containment.start()

    def begin_shutdown(self) -> None:
        """Stop scheduling now (a signal arrived); :meth:`stop` follows once uvicorn lets go."""
        if self._stop_asked_at is not None:
            return
        self._stop_asked_at = time.monotonic()
        if self.scheduler.running:
            # Pause, not shut down: shutting APScheduler's asyncio executor down cancels its jobs.
            self.scheduler.pause()
            grace = self.settings.api.shutdown_grace_seconds
            log.info("stopping: no new probe runs; runs in flight get %.0fs", grace)

    async def stop(self, drain_seconds: float | None = None) -> None:
        """Stop scheduling, let runs in flight finish (cancelling stragglers), close clients."""
        self.begin_shutdown()
        grace = self.settings.api.shutdown_grace_seconds if drain_seconds is None else drain_seconds
        # One grace from the signal, not two: uvicorn has already spent part of it on open requests.
        assert self._stop_asked_at is not None  # begin_shutdown() has just set it
        grace = max(0.0, grace - (time.monotonic() - self._stop_asked_at))
        cancelled = await self.runner.drain(grace)
        if cancelled:
            log.warning("cancelled %d probe run(s) still in flight at shutdown", cancelled)
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        if self.stream is not None:  # its batches in hand are recorded (the writer still runs) and acked
            await self.stream.stop()
        if self.pager is not None and self._pager_task is not None:
            await self.pager.stop(self._pager_task)
        for client in self.clients.values():
            await client.aclose()
        await self.http.aclose()
        await asyncio.to_thread(self.writer.close)
        if self.events is not None:  # after the writer: the last verdicts' events go too
            await asyncio.to_thread(self.events.stop)
        if len(self.spool):
            await asyncio.to_thread(self.recorder.replay)
        if len(self.spool):
            log.warning(
                "%d result(s) still spooled in %s; replayed at the next start",
                len(self.spool),
                self.spool.where,
            )
        self.spool.close()
        await asyncio.to_thread(self.membership.leave)
        self.engine.dispose()
        if self.sqlite is not None:
            self.sqlite.close()
        log.info("kvcanary stopped cleanly")


def create_app(monitor: Monitor, *, start_scheduler: bool = True) -> FastAPI:
    """Return the HTTP app: ``/api/v1`` (bearer token), ``/healthz`` and ``/metrics``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if start_scheduler:
            monitor.start()
        # Everything built at start-up lives as long as the process: keep it out of the collector's
        # full passes, which otherwise stall every request and probe for ~100 ms at scale.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await monitor.stop()

    state = ApiState(
        session_factory=monitor.read_session_factory,
        api_token=monitor.token,
        settings=monitor.settings,
        run_now=RunNow(monitor.runner.run_target, monitor.settings.api.run_now_min_interval_seconds),
        health=monitor.health,
        metrics_page=monitor.metrics.exposition,
        reload=monitor.reload,
        ingest_token=monitor.ingest_token,
        traffic=monitor.traffic,
        judge=monitor.traffic.judge,
        containment=monitor.containment,
    )
    app = build_http_app(state, lifespan=lifespan)
    # Routers read the settings in force: a reload hands them the new ones.
    monitor.on_reload.append(
        lambda new: setattr(app.state, "api", dataclasses.replace(app.state.api, settings=new))
    )
    return app
