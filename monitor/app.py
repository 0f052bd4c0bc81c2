"""The composition root: the only place where settings, storage, targets, probes, the scheduler
and the metrics are wired together (``http_app.py`` puts the REST API in front).

``Monitor.open`` reads what the monitor needs from the world (``opening.py``: its secrets, the
traffic stream, the database and the spool) and builds it: every part made here, once, handed
what it works with; ``start`` takes up the world and starts the loops; ``stop`` drains and closes.
``http_app.py`` serves it over HTTP. Taking up new settings while running is ``reloads.py``'s, given
the parts it changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcanary.monitor.config.secrets import TenantKeys
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.containment import Containment, Verifier
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.opening import Database, Secrets, check_stream
from kvcanary.monitor.paging.pager import Delivery, Pager, paging_health
from kvcanary.monitor.recording.health import WriteHealth
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.port import RecordingPort
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.recording.upkeep import StorageUpkeep
from kvcanary.monitor.recording.writer import BatchWriter
from kvcanary.monitor.reloads import InForce, Reloader
from kvcanary.monitor.runs.coverage import run_keys
from kvcanary.monitor.runs.discovery import DISCOVERY_TICK_SECONDS, GatewayDiscovery
from kvcanary.monitor.runs.replicas import HEARTBEAT_SECONDS, Membership
from kvcanary.monitor.runs.runner import ProbeRunner, RunSummary
from kvcanary.monitor.runs.scheduler import Housekeeping, assign, build_scheduler, run_now
from kvcanary.monitor.storage import outbox
from kvcanary.monitor.storage.incident_rows import open_incident_counts
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


class Monitor:
    """Everything ``kvcanary serve`` runs, built from what :meth:`open` read without reading
    anything itself; :meth:`start` starts it and :meth:`stop` drains and closes it.

    ``on_summary`` is called with each probe run's summary (the demo prints them); ``config_path``
    is the file SIGHUP and ``POST /-/reload`` read again (None: nothing to reload from).
    """

    @classmethod
    def open(
        cls,
        settings: Settings,
        *,
        metrics: MonitorMetrics | None = None,
        on_summary: Callable[[RunSummary], None] | None = None,
        config_path: Path | None = None,
    ) -> Monitor:
        """Read the secrets, check the traffic stream where one is used, open the database and the
        spool; return the monitor built on them, not started.

        Raises ``ConfigError`` (a secret missing or unusable, NATS not reached), ``DatabaseNotMigrated``
        (an old schema) or ``DatabaseInUse`` (a SQLite file another process holds).
        """
        secrets = Secrets.read(settings)
        if settings.traffic.source == "jetstream":
            check_stream(settings, secrets.nats_token)
        database = Database.open(settings)
        return cls(
            settings, secrets, database, metrics=metrics, on_summary=on_summary, config_path=config_path
        )

    def __init__(
        self,
        settings: Settings,
        secrets: Secrets,
        database: Database,
        *,
        metrics: MonitorMetrics | None = None,
        on_summary: Callable[[RunSummary], None] | None = None,
        config_path: Path | None = None,
    ):
        self.config_path = config_path
        #: The settings and tenant keys in force, which the reloader replaces.
        self.in_force = InForce(settings, secrets.tenant_keys)
        self.token = secrets.api_token
        self.ingest_token = secrets.ingest_token
        self.database = database
        self.session_factory = database.session_factory
        self.read_session_factory = database.read_session_factory
        self.spool = database.spool
        self.metrics = metrics or MonitorMetrics()
        self.markers = MarkerBook(ttl_seconds=settings.marker_ttl_seconds, key=secrets.marker_key)
        self._limits = Limits(**settings.limits.model_dump())
        # One connection pool and TLS context for every target (not one per target). Runs in
        # overtime keep their connections: the pool must not become a first-come semaphore again.
        scheduler = settings.scheduler
        self.http = HttpClient(max(64, (scheduler.max_concurrency + scheduler.max_overtime_runs) * 4))
        #: The targets' clients by name, shared by the runner, the judge and containment; a reload
        #: replaces them in place.
        self.clients = {t.name: self.client_of(t, secrets.tenant_keys) for t in settings.targets}
        self._stop_asked_at: float | None = None  # time.monotonic() of the signal; set: stopping
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once started
        self._pager_task: asyncio.Task[None] | None = None
        self._guards_read: asyncio.Task[None] | None = None
        self._build_recording(settings, secrets)
        self.membership = Membership(self.session_factory, shared=database.shared, url=settings.api.base_url)
        self.runner = ProbeRunner(
            settings, self.clients, self.markers, self.metrics, self.port, on_summary,
            owns=self.membership.owns, on_config_change=self._reaudit,
        )  # fmt: skip
        self._build_traffic(settings, secrets)
        self.pager = self._pager(settings, secrets)
        # What the gateways are told to do about each deployment (monitor/containment/): the
        # quarantines, the admission guards' facts and, on NATS, the bucket the taps watch.
        self.containment = Containment(
            self.session_factory, lambda: self.settings, self.clients, self.judge.facts,
            on_change=self._quarantine_changed,
            connection=self.stream.connection if self.stream is not None else None,
            # A suspected leak is verified at once by the probes that can prove it.
            verifier=Verifier(
                lambda: self.settings, self.runner.run, self.session_factory,
                self.metrics.suspicion_verifications,
            ),
            signer=secrets.signer,
        )  # fmt: skip
        # Nodes found from SGLang gateways (monitor/runs/discovery.py), taken up as a reload would.
        self.discovery = GatewayDiscovery(settings, self.http, self._limits)
        self.scheduler = build_scheduler(
            settings, self.runner, housekeeping=self._housekeeping(), owns=self.membership.owns
        )
        #: Called with the new settings after each reload that took (the HTTP app's state).
        self.on_reload: list[Callable[[Settings], None]] = []
        self.reloader = Reloader(
            self.in_force, config_path=config_path, clients=self.clients,
            client_of=self.client_of, runner=self.runner, recorder=self.recorder, judge=self.judge,
            pager=self.pager, containment=self.containment, discovery=self.discovery,
            scheduler=self.scheduler, owns=self.membership.owns, metrics=self.metrics,
            listeners=self.on_reload,
        )  # fmt: skip
        self._watch(secrets)

    def _build_recording(self, settings: Settings, secrets: Secrets) -> None:
        """Make the recorder, its batching writer, the verdicts' events and the one port in front."""
        sqlite = self.database.sqlite
        health = WriteHealth(file_check=sqlite.check if sqlite is not None else None)
        self.recorder = Recorder(settings, self.session_factory, self.spool, health)
        self.writer = BatchWriter(self.recorder)
        self.upkeep = StorageUpkeep(
            lambda: self.settings, self.session_factory, self.recorder, self.database.engine, sqlite
        )
        # Opt-in: every verdict as an OpenTelemetry GenAI evaluation event (monitor/otel.py).
        self.events: VerdictEvents | None = None
        if settings.otel is not None:
            from kvcanary.monitor.otel import VerdictEvents  # the SDK only when used

            dropped = self.metrics.otel_dropped
            self.events = VerdictEvents(settings.otel, dropped, headers=secrets.otlp_headers)
        # Probe runs and gateway traffic record through one port, which pages at once on a change.
        self.port = RecordingPort(
            self.writer, on_change=self._page_now, on_suspicion=self._verify,
            on_recorded=self.events.offer if self.events is not None else None,
        )  # fmt: skip

    def _build_traffic(self, settings: Settings, secrets: Secrets) -> None:
        """Make the traffic judge and the one pipeline for posted and streamed records; posts are
        published to the stream where one is used."""
        keys = own_key_digests(secrets.tenant_keys)
        self.judge = TrafficJudge(settings, self.clients, self.markers, self.metrics, keys)
        jetstream = settings.traffic.jetstream
        pipeline = TrafficPipeline(self.judge, self.port, self.session_factory, jetstream.partitions)
        self.stream: TrafficStream | None = None
        publisher = None
        if settings.traffic.source == "jetstream":
            from kvcanary.monitor.traffic.jetstream import TrafficStream  # nats-py only when used

            self.stream = TrafficStream(jetstream, pipeline, self.membership.id, secrets.nats_token)
            publisher = StreamPublisher(jetstream, self.stream.connection)
        self.traffic = HttpIngest(pipeline, self.membership, publisher)

    def _pager(self, settings: Settings, secrets: Secrets) -> Pager | None:
        """Return the pager of every Alertmanager configured; None when there is none."""
        if not settings.alertmanagers:
            return None
        headers = secrets.alertmanager_headers
        delivery = Delivery(headers, self.metrics, settings.alerting.timeout_seconds)
        return Pager(settings, self.session_factory, delivery, link_key=self.token)

    def _housekeeping(self) -> list[Housekeeping]:
        """Return the clock's jobs besides the probes: (name, what it runs, every how many seconds)."""
        return [
            ("gateway-discovery", self.discover, DISCOVERY_TICK_SECONDS),
            *self.containment.jobs(),
            *self.upkeep.jobs(),
            ("heartbeat", self.heartbeat, HEARTBEAT_SECONDS),
        ]

    def _watch(self, secrets: Secrets) -> None:
        """Hand ``/metrics`` what it reads of each part at a scrape."""
        metrics = self.metrics
        metrics.watch_spool(self.spool)
        metrics.watch_incidents(
            self._open_incident_counts, lambda: run_keys(self.settings), self.recorder.health
        )
        if self.stream is not None:
            metrics.watch_stream(self.stream.report)
        metrics.watch_replicas(lambda: self.membership.counts(self.settings))
        if self.pager is not None:
            metrics.declare_alertmanagers(secrets.alertmanager_headers)
            metrics.watch_outbox(self._outbox_backlog)
        metrics.watch_containment(
            lambda: [t.name for t in self.settings.targets],
            lambda: [(q.target, q.enforced) for q in self.containment.known],
            self.containment.report,
        )
        metrics.watch_gateways(
            lambda: self.discovery.health, lambda: self.discovery.circuits,
            lambda: self.discovery, lambda: self.judge.facts.untrusted,
        )  # fmt: skip

    @property
    def settings(self) -> Settings:
        """The settings in force (a reload replaces them)."""
        return self.in_force.settings

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
        self.judge.facts.forget_pools(target.name)  # gateway records: judged by the new pool
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

    async def heartbeat(self) -> None:
        """Say this replica is alive; where the live replicas changed, take up and hand over jobs."""
        if await asyncio.to_thread(self.membership.beat):
            gained, lost = assign(self.scheduler, self.settings, self.membership.owns)
            self.runner.forget_states(gained)
            log.info("replicas changed: %d probe jobs taken up, %d handed over", len(gained), len(lost))

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
        return await self.reloader.take_up_file(why)

    async def discover(self) -> None:
        """Read the SGLang gateways that are due; a change of their nodes is taken up as a reload."""
        if changes := await self.discovery.refresh():
            await self.reloader.take_up_nodes(changes)

    def start(self) -> None:
        """Take up the world, then start the clock, the pager, the traffic stream, the verdicts'
        events and containment's first reading of the pools. Once a stop was asked (SIGTERM during
        start-up) nothing starts."""
        if self._stop_asked_at is not None:
            return
        self._take_up_world()
        if self._stop_asked_at is not None:  # the signal came while the database was read
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

    def _take_up_world(self) -> None:
        """What the first runs need: the other replicas known (their pairs' jobs paused now, not a
        heartbeat later), every target's row, and every stored probe state read in one go."""
        self.membership.beat()
        assign(self.scheduler, self.settings, self.membership.owns)
        self.recorder.ensure_targets(self.settings.targets)
        if (stored := self.recorder.load_states()) is not None:
            self.runner.preload_states(stored)

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
        await asyncio.to_thread(self.membership.leave)
        self.database.close()
        log.info("kvcanary stopped cleanly")
