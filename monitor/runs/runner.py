"""Run one probe against one target and record what it concluded.

The runner owns everything around a probe, as blackbox_exporter's handler does: the timeout,
the timing, turning a crash into an ``error`` verdict, the final leak judgement over every
response (:func:`probes.base.judge`), the database row, the incident lifecycle and the metrics.
Probes only compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.incidents import RecordOutcome
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.result_writer import ResultWriter
from kvcanary.monitor.runs.coverage import Where, bound_to, declare_coverage, nodes_of_run, run_keys
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.runs.slots import FairSlots
from kvcanary.monitor.runs.turns import SHARED, TargetTurns
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServingPath, TargetClient

log = logging.getLogger("kvcanary.runner")
T = TypeVar("T")


#: Reasons that say a run waited out a timeout: its target is known to hang until a run ends otherwise.
HUNG_REASONS = frozenset({"timeout", "probe_timeout"})
#: A run on a target known to hang ends this many of its timeouts in (its first timeout, and slack).
HUNG_BUDGET_TIMEOUTS = 1.25


@dataclass(frozen=True)
class RunSummary:
    """What one run of a kind on a target (or one of its nodes) concluded, and what recording it did."""

    target: str
    kind: str
    node: str
    result: ProbeResult
    started_at: datetime
    duration_seconds: float
    outcome: RecordOutcome | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "probe": self.kind,
            "node": self.node,
            "verdict": self.result.verdict.value,
            "reason": self.result.reason,
            "detail": self.result.detail,
            "result_id": self.outcome.result_id if self.outcome else None,
            "incident_id": self.outcome.incident_id if self.outcome else None,
        }


@dataclass(frozen=True)
class _Run:
    result: ProbeResult
    started_at: datetime
    duration: float


StateKey = tuple[str, str, str]


class ProbeRunner:
    """Runs probes with bounded concurrency, never two runs of one (target, kind, node) at once,
    and a kind that runs alone (``boundary``) with no other kind's run on its target.

    Slots are shared fairly (``monitor/runs/slots.py``): a hung or slow target costs its own runs,
    and a target known to hang gets one timeout per run, not the kind's whole budget.

    ``writer`` is the one way results are recorded (the recording port, which pages on a change;
    a bare writer in tests; ``NotRecorded`` in a dry run, every run from an empty state) and stored
    states read. ``on_summary`` is called with each run's summary; ``owns`` says whether this
    replica runs (target, kind) on its clock (``monitor/runs/replicas.py``; all by default);
    ``on_config_change`` is called with (target, node) when a capacity audit saw the node's
    configuration change.
    """

    def __init__(
        self,
        settings: Settings,
        clients: Mapping[str, TargetClient],
        markers: MarkerBook,
        metrics: MonitorMetrics,
        writer: ResultWriter,
        on_summary: Callable[[RunSummary], None] | None = None,
        *,
        owns: Callable[[str, str], bool] = lambda target, kind: True,
        on_config_change: Callable[[TargetConfig, str], None] | None = None,
    ):
        self.settings = settings
        self.clients = clients
        self.markers = markers
        self.metrics = metrics
        self.writer = writer
        self.on_summary = on_summary
        self.owns = owns
        self.on_config_change = on_config_change
        scheduler = settings.scheduler
        self.slots = FairSlots(
            scheduler.max_concurrency,
            scheduler.max_concurrency_per_target,
            scheduler.slow_share,
            overtime=scheduler.max_overtime_runs,
            unknown_cost=scheduler.slot_lease_seconds,
        )
        self.lease_seconds = scheduler.slot_lease_seconds
        #: Targets whose last run ended within its slot lease (``quick``; any other counts as slow,
        #: a target never seen to run too), and those whose last run waited out a timeout (``hanging``).
        self.quick: set[str] = set()
        self.hanging: set[tuple[str, str]] = set()
        metrics.watch_slots(
            lambda: (
                self.slots.in_use,
                self.slots.in_overtime,
                self.slots.waiting,
                len({target for target, _ in self.hanging}),
            )
        )
        self.turns = TargetTurns()
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}
        self._states: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._client_runs: Counter[int] = Counter()  # runs in flight by client (a reload replaces them)
        # When each scheduled run was due, noted by the scheduler as it submits the run.
        self._due: dict[tuple[str, str], datetime] = {}
        for target in settings.targets:
            metrics.declare(target.name, {kind: target.interval_for(kind) for kind in target.probes})
            declare_coverage(metrics, target)
            for tenant in target.tenants:
                markers.register(target.name, tenant.name)

    def note_due(self, target: str, kind: str, due: datetime) -> None:
        """Remember when the scheduled run of (target, kind) about to start was due (for its lag)."""
        self._due[(target, kind)] = due

    async def run_scheduled(self, target_name: str, kind: str) -> list[RunSummary]:
        """Run (target, kind) when the clock says so, if it is this replica's to run (``owns``).

        Each node or path the run covers keeps its own cadence: one whose last run is still going
        (a node hung behind a gateway that retries it) is skipped, and the clock's job waits for the
        rest no longer than the kind's interval, so a slow one never holds back its siblings' next
        runs (or leaves their paths unjudged). Return the summaries of the runs that ended in time.
        """
        target = self.settings.target(target_name)
        if not self.owns(target_name, kind) or target is None or kind not in target.probes:
            self._due.pop((target_name, kind), None)  # not ours, or a reload has just removed it
            return []
        due = self._due.pop((target_name, kind), None)
        started: list[asyncio.Task[RunSummary]] = []
        for where in nodes_of_run(target, kind):
            node = where.name if where else ""
            lock = self._locks.get((target.name, kind, node))
            if lock is not None and lock.locked():
                log.info("%s/%s@%s: its last run is still going; skipped", target.name, kind, node)
                continue
            started.append(self._track(asyncio.ensure_future(self._run_held(target, kind, where, due))))
        if not started:
            return []
        done, _ = await asyncio.wait(started, timeout=target.interval_for(kind))
        return [task.result() for task in started if task in done]

    async def run(self, target_name: str, kind: str) -> list[RunSummary]:
        """Run one probe kind on one target (on each of its nodes when node-scoped) and record each
        result. Raise KeyError for an unknown target or kind."""
        target = self.settings.target(target_name)
        if target is None or kind not in target.probes:
            raise KeyError(f"{target_name}/{kind}")
        if (task := asyncio.current_task()) is not None:
            self._track(task)
        due = self._due.pop((target_name, kind), None)
        runs = (self._run_held(target, kind, where, due) for where in nodes_of_run(target, kind))
        return list(await asyncio.gather(*runs))

    def _track(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        """Count ``task`` in flight until it ends (``drain`` waits for it); return it."""
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return task

    async def _run_held(
        self, target: TargetConfig, kind: str, where: Where, due: datetime | None
    ) -> RunSummary:
        # The client of the settings the run started under, held until it ends: a reload that
        # replaces or removes the target meanwhile closes it only once its runs are over.
        with self._using(self.clients[target.name]) as client:
            return await self._run_one(target, kind, where, client, due)

    async def _run_one(
        self,
        target: TargetConfig,
        kind: str,
        node: Where,
        client: TargetClient,
        due: datetime | None = None,
    ) -> RunSummary:
        key = (target.name, kind, node.name if node else "")
        # The pair's lock keeps its runs, and their recordings, in order; the target's turn keeps
        # a lone kind's runs apart from the other kinds' (taken before a slot: a lone run waiting
        # for its turn holds none); a slot bounds the runs talking to targets at once, and is
        # given back before the (batched) recording.
        group = kind if REGISTRY[kind].runs_alone else SHARED
        async with self._locks.setdefault(key, asyncio.Lock()):
            async with self.turns.take(target.name, group):
                run = await self._in_slot(target, kind, node, client, key, due)
            item = PendingResult.of(target, kind, run.result, run.started_at, run.duration, node=key[2])
            outcome = await self.writer.submit(item)
        result = run.result
        now_target = self.settings.target(target.name)
        if now_target is not None and kind in now_target.probes:  # a reload may have removed it meanwhile
            self.metrics.observe(target.name, kind, result, run.duration, time.time(), key[2])
            if result.verdict is not Verdict.ERROR and isinstance(node, ServingPath):
                self.metrics.paths.judged(target.name, (node.prefill_name, node.decode_name), time.time())
            elif result.verdict is not Verdict.ERROR and node is not None:
                self.metrics.nodes.judged(target.name, node.name, time.time())
        summary = RunSummary(target.name, kind, key[2], result, run.started_at, run.duration, outcome)
        where = f"{target.name}/{kind}" + (f"@{key[2]}" if key[2] else "")
        log.info("%s: %s (%s) in %.2fs", where, result.verdict.value, result.reason, run.duration)
        if self.on_summary:
            self.on_summary(summary)
        if result.measurements.get("config_changed") and self.on_config_change is not None:
            self.on_config_change(target, key[2])
        return summary

    async def _in_slot(
        self,
        target: TargetConfig,
        kind: str,
        where: Where,
        client: TargetClient,
        key: StateKey,
        due: datetime | None,
    ) -> _Run:
        """Run the probe holding a fair slot; return its judged result (the state to keep set)."""
        client, node = bound_to(client, where)
        async with self.slots.hold(target.name, slow=target.name not in self.quick) as lease:
            # Past its lease a run waiting on the network gives its slot to the next one.
            lease_ends = asyncio.get_running_loop().call_later(
                min(self.lease_seconds, target.timeout_seconds), lease.overtime
            )
            try:
                if due is not None:
                    self.metrics.schedule_lag.observe(max(0.0, (datetime.now(UTC) - due).total_seconds()))
                state = await self._state(key)
                started_at = datetime.now(UTC)

                def keep(cut: ProbeResult, took: float) -> None:
                    self._keep_finding(PendingResult.of(target, kind, cut, started_at, took, node=key[2]))

                hung = (target.name, kind) in self.hanging
                budget = target.timeout_seconds * HUNG_BUDGET_TIMEOUTS if hung else None
                result, duration = await execute_probe(
                    kind, client, self.markers, target, node=node, state={} if state is None else state,
                    on_cancelled=keep, budget=budget,
                )  # fmt: skip
            finally:
                lease_ends.cancel()
        self._note_pace(target.name, kind, result, lease.expired, cut=hung)
        if state is None or (result.state is not None and result.state == state):
            # Unchanged (a capacity audit's fingerprint): nothing to write. Unread (the database
            # was away): what a run from an empty state leaves must not replace what is stored.
            result.state = None
        elif result.state is not None:
            self._states[key] = result.state
        if isinstance(where, ServingPath):  # the pair a finding came from, by its nodes' whole names
            result.evidence["path"] = {"prefill": where.prefill_name, "decode": where.decode_name}
        return _Run(result, started_at, duration)

    def take_up(self, settings: Settings) -> None:
        """Take up reloaded settings: declare new pairs, name new tenants, forget removed targets."""
        self.settings = settings
        names = {t.name for t in settings.targets}
        for target in settings.targets:
            self.metrics.declare(target.name, {kind: target.interval_for(kind) for kind in target.probes})
            declare_coverage(self.metrics, target)
            for tenant in target.tenants:
                self.markers.register(target.name, tenant.name)
        keys = set(run_keys(settings))
        for key in [k for k in self._states if k not in keys]:
            del self._states[key]
        self.slots.forget(names)
        self.quick &= names
        self.hanging = {(t, k) for t, k in self.hanging if t in names}

    @contextlib.contextmanager
    def _using(self, client: TargetClient) -> Iterator[TargetClient]:
        self._client_runs[id(client)] += 1
        try:
            yield client
        finally:
            self._client_runs[id(client)] -= 1

    async def close_when_idle(self, client: TargetClient) -> None:
        """Close a client a reload replaced, once no run in flight uses it."""
        while self._client_runs[id(client)]:
            await asyncio.sleep(0.5)
        self._client_runs.pop(id(client), None)
        if (close := getattr(client, "aclose", None)) is not None:  # HTTP targets hold connections
            await close()

    def _note_pace(
        self, target: str, kind: str, result: ProbeResult, outlived_lease: bool, cut: bool
    ) -> None:
        """Note whether the target is quick, and whether (target, kind) hangs: a request of its own
        timed out. A run cut by the shortened budget itself says nothing (it would re-arm forever)."""
        quick = not outlived_lease and result.reason not in HUNG_REASONS
        (self.quick.add if quick else self.quick.discard)(target)
        hangs = result.reason == "timeout" or (result.reason == "probe_timeout" and not cut)
        if hangs and (target, kind) not in self.hanging:
            log.warning("%s/%s: a run waited out its timeout; next runs get one timeout each", target, kind)
        (self.hanging.add if hangs else self.hanging.discard)((target, kind))

    def _keep_finding(self, item: PendingResult) -> None:
        """Record what a cancelled run had already found, if it is a leak or a mismatch: a marker read
        before shutdown is as much a leak as one read at the end. Queued, not awaited (the run is
        being cancelled); the writer records it before it stops."""
        verdict = item.result.verdict
        if not verdict.is_failure:
            return
        log.warning("%s/%s cancelled after finding a %s: recording it", item.target, item.kind, verdict)
        self.metrics.observe(
            item.target, item.kind, item.result, item.duration_seconds, time.time(), item.node
        )
        self.writer.enqueue(item)

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for runs in flight, then cancel the rest; return how many."""
        pending = {t for t in self._in_flight if t is not asyncio.current_task()}
        if not pending:
            return 0
        _, late = await asyncio.wait(pending, timeout=timeout)
        for task in late:
            task.cancel()
        if late:  # let them unwind before the caller closes the clients they use
            await asyncio.wait(late, timeout=5)
        return len(late)

    async def run_target(self, target_name: str) -> list[dict[str, Any]]:
        """Run every probe of one target, in its configured order; raise KeyError when unknown."""
        target = self.settings.target(target_name)
        if target is None:
            raise KeyError(target_name)
        out = []
        for kind in target.probes:
            out += [summary.as_dict() for summary in await self.run(target_name, kind)]
        return out

    def preload_states(self, stored: Mapping[tuple[str, str, str], dict[str, Any]]) -> None:
        """Fill the state cache of every pair from one read at start: thousands of first runs
        reading their state one query each would cost a core for most of the first interval."""
        for key in run_keys(self.settings):
            self._states.setdefault(key, dict(stored.get(key) or {}))

    def forget_states(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Drop what is cached for (target, kind) pairs another replica has run meanwhile: their
        next run here reads the state that replica stored."""
        gone = set(pairs)
        for key in [key for key in self._states if key[:2] in gone]:
            del self._states[key]

    async def _state(self, key: tuple[str, str, str]) -> dict[str, Any] | None:
        """Return what the probe left at its last run: kept in memory, read from the database once;
        None while the database cannot say (read again at the next run)."""
        if key not in self._states:
            stored = await asyncio.to_thread(self.writer.load_state, *key)
            if stored is None:
                return None
            self._states[key] = stored
        return self._states[key]
