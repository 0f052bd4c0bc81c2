"""Every metric the monitor exports, in one file, on a registry of its own.

Labels are bounded: ``target`` and ``probe`` come from the config file, ``verdict`` and
``severity`` from fixed enums. ``kvcanary_incidents_open`` is read from the database at scrape
time, so it is right across restarts and across replicas that share one PostgreSQL.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcanary.monitor.metrics.containment import ContainmentReport, QuarantineCollector, Quarantined
from kvcanary.monitor.metrics.coverage import UnprobedPaths, node_coverage, path_coverage
from kvcanary.monitor.metrics.exposition import TOKEN_KINDS, PairSeries, escape, render_gauge
from kvcanary.monitor.metrics.gateway import (
    GatewayCircuits,
    GatewayHealth,
    GatewayHealthCollector,
    GatewayReads,
)
from kvcanary.monitor.metrics.pool_trust import UntrustedPools, UntrustedPoolsCollector
from kvcanary.monitor.metrics.stream import StreamCollector
from kvcanary.monitor.metrics.versions import REFUSED_VERSIONS, VersionRefusalsCollector
from kvcanary.monitor.recording.health import WriteHealth
from kvcanary.probes.base import ProbeResult, Verdict

if TYPE_CHECKING:
    from kvcanary.monitor.recording.spool import Spool

# ``*_created`` series double the exposition and no rule or dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

SEVERITIES = ("critical", "high", "warning")
DELIVERY_OUTCOMES = ("accepted", "rejected", "failed")
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Probe runs range from a 20 ms canary to a boundary probe that ships millions of tokens.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

OPEN = (
    "kvcanary_incidents_open",
    "Open incidents by target, probe, node, severity and certainty (from the database; last known "
    "while it is down).",
)
READ_AT = (
    "kvcanary_incidents_open_read_timestamp_seconds",
    "Unix time the open incident counts were last read from the database.",
)
DB_UP = (
    "kvcanary_database_up",
    "1 when results are being written: the last write landed and the database answered this scrape.",
)
WRITTEN_AT = (
    "kvcanary_database_last_write_success_timestamp_seconds",
    "Unix time a result last landed in the database; 0 before the first.",
)
FAILED_AT = (
    "kvcanary_database_last_write_failure_timestamp_seconds",
    "Unix time a write of results last failed (spooled); 0 when none has.",
)

OpenIncidentCounts = Callable[[], Iterable[tuple[str, str, str, str, str, int]]]
#: Every (target, probe, node) the config makes: their series are exported at 0.
Pairs = Callable[[], Iterable[tuple[str, str, str]]]


class OpenIncidentsCollector(Collector):
    """Export ``kvcanary_incidents_open`` from ``(target, probe, node, severity, certainty, count)``
    rows. Every configured (target, probe, node) has its severities at 0 as ``certain`` (what a
    probe's incident is); an incident of another certainty (a traffic check's ``suspected``, an
    operator's ``confirmed``) has its series while it is open.

    When the database does not answer, the last counts read are exported again, so alerts on
    open incidents keep firing through an outage; ``kvcanary_database_up`` goes to 0 and
    ``kvcanary_incidents_open_read_timestamp_seconds`` says how old the counts are.
    """

    def __init__(self, counts: OpenIncidentCounts, pairs: Pairs, writes: WriteHealth | None = None):
        self._counts = counts
        self._pairs = pairs
        self._writes = writes or WriteHealth()
        self._last: dict[tuple[str, str, str, str, str], int] = {}
        self._read_at = 0.0

    def _read(self) -> int:
        """Refresh the counts from the database; return 1, or 0 (keeping the last counts) when it is away."""
        try:
            values = {(t, p, n, s, "certain"): 0 for t, p, n in self._pairs() for s in SEVERITIES}
            for target, probe, node, severity, certainty, count in self._counts():
                values[(target, probe, node, severity, certainty)] = count
            self._last, self._read_at = values, time.time()
        except Exception:  # a database hiccup must not break the scrape: serve the last known counts
            return 0
        return 0 if self._writes.failing else 1

    def collect(self) -> Iterator[Metric]:
        up = self._read()
        names = ["target", "probe", "node", "severity", "certainty"]
        family = GaugeMetricFamily(OPEN[0], OPEN[1], labels=names)
        for labels, count in sorted(self._last.items()):
            family.add_metric(list(labels), count)
        yield family
        yield GaugeMetricFamily(READ_AT[0], READ_AT[1], value=self._read_at)
        yield GaugeMetricFamily(DB_UP[0], DB_UP[1], value=up)
        yield GaugeMetricFamily(*WRITTEN_AT, value=self._writes.last_success_at)
        yield GaugeMetricFamily(*FAILED_AT, value=self._writes.last_failure_at)

    def render(self) -> str:
        """The same families in the text format, written directly (thousands of rows at scale)."""
        up = self._read()
        rows = (
            (f'certainty="{c}",node="{escape(n)}",probe="{escape(p)}",severity="{s}",{_target(t)}', count)
            for (t, p, n, s, c), count in sorted(self._last.items())
        )
        return (
            render_gauge(*OPEN, rows)
            + render_gauge(*READ_AT, [("", self._read_at)])
            + render_gauge(*DB_UP, [("", up)])
            + render_gauge(*WRITTEN_AT, [("", self._writes.last_success_at)])
            + render_gauge(*FAILED_AT, [("", self._writes.last_failure_at)])
        )


def _target(name: str) -> str:
    return f'target="{escape(name)}"'


class SpoolCollector(Collector):
    """Export the spool's backlog and what it had to drop (``monitor/recording/spool.py``)."""

    def __init__(self, spool: Spool):
        self._spool = spool

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvcanary_spool_results",
            "Probe results waiting in the local spool for the database to come back.",
            value=len(self._spool),
        )
        yield GaugeMetricFamily(
            "kvcanary_spool_max_results",
            "Results the spool holds at most (spool.max_entries); past it, the least news is dropped.",
            value=self._spool.max_entries,
        )
        dropped = CounterMetricFamily(
            "kvcanary_results_dropped",
            "Probe results lost: the spool was full of worse news, or the database refused them twice.",
            labels=["verdict"],
        )
        for verdict in Verdict:
            dropped.add_metric([verdict.value], self._spool.dropped[verdict.value])
        yield dropped


class OutboxCollector(Collector):
    """Export the paging backlog, read from the database at scrape time (nothing while it is down)."""

    def __init__(self, backlog: Callable[[], tuple[int, float]]):
        self._backlog = backlog

    def collect(self) -> Iterator[Metric]:
        try:
            events, oldest = self._backlog()
        except Exception:  # the database is away: kvcanary_database_up says so; no made-up backlog
            return
        yield GaugeMetricFamily(
            "kvcanary_alert_outbox_events",
            "Incident events not yet delivered to any Alertmanager.",
            value=events,
        )
        yield GaugeMetricFamily(
            "kvcanary_alert_outbox_oldest_age_seconds",
            "Age of the oldest undelivered incident event; 0 when none waits.",
            value=oldest,
        )


class ReplicaCollector(Collector):
    """Export how many replicas share the work and how many (target, probe) pairs this one runs."""

    def __init__(self, counts: Callable[[], tuple[int, int]]):
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        live, owned = self._counts()
        yield GaugeMetricFamily(
            "kvcanary_replicas", "Live monitor replicas sharing the database.", value=live
        )
        yield GaugeMetricFamily(
            "kvcanary_pairs_owned", "(target, probe) pairs this replica runs on its clock.", value=owned
        )


class SlotsCollector(Collector):
    """Export the run slots in use, the runs waiting for one, and the targets known to hang."""

    def __init__(self, counts: Callable[[], tuple[int, int, int, int]]):
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        in_use, overtime, waiting, hanging = self._counts()
        yield GaugeMetricFamily("kvcanary_run_slots_in_use", "Probe runs holding a slot now.", value=in_use)
        yield GaugeMetricFamily(
            "kvcanary_runs_in_overtime",
            "Probe runs past their slot lease, still waiting on their target without a slot.",
            value=overtime,
        )
        yield GaugeMetricFamily(
            "kvcanary_run_slots_waiting", "Probe runs due and waiting for a slot.", value=waiting
        )
        yield GaugeMetricFamily(
            "kvcanary_targets_hanging",
            "Targets whose last run waited out a timeout (their runs share a bounded part of the slots).",
            value=hanging,
        )


class MonitorMetrics:
    """The monitor's own metrics. One instance per process (tests make their own).

    ``registry`` holds every family (what ``generate_latest`` and the tests read); ``exposition()``
    is what ``/metrics`` serves: the same families, the per-pair ones written directly.
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        # The families prometheus-client formats: few series each, whatever the number of targets.
        self._general = CollectorRegistry()
        self.pairs = PairSeries()
        self._incidents: OpenIncidentsCollector | None = None
        self.registry.register(self._general)
        self.registry.register(self.pairs)
        #: When each prefill x decode path of a disaggregated target was last judged.
        self.paths = path_coverage()
        self.nodes = node_coverage()
        self.gateway_node_changes = Counter(
            "kvcanary_gateway_node_changes_total",
            "Nodes that joined or left a target's SGLang gateway listing, as discovery read it (its "
            "first reading counts every node listed as joined).",
            ["target", "change"],
            registry=self._general,
        )
        self.suspicion_verifications = Counter(
            "kvcanary_suspicion_verifications_total",
            "Suspected leaks verified at once by the target's proving probes, by what the runs found "
            "(monitor/containment/verification.py).",
            ["target", "outcome"],
            registry=self._general,
        )
        #: The pairs of a target's nodes that no run goes down (runs/coverage.py: declare_coverage).
        self.paths_unprobed = UnprobedPaths()
        self._general.register(self.paths)
        self._general.register(self.nodes)
        self._general.register(self.paths_unprobed)
        # A histogram per (target, probe) is 16 series a pair (80,000 at 5,000 targets); the
        # distribution is kept per probe kind, and each pair's last duration is a gauge.
        self.probe_duration = Histogram(
            "kvcanary_probe_duration_seconds",
            "Wall time of one probe run, by probe kind.",
            ["probe"],
            buckets=DURATION_BUCKETS,
            registry=self._general,
        )
        self.alert_deliveries = Counter(
            "kvcanary_alert_deliveries_total",
            "Posts of alerts to each Alertmanager, by outcome (accepted, rejected, failed).",
            ["alertmanager", "outcome"],
            registry=self._general,
        )
        self.alert_backoff = Gauge(
            "kvcanary_alert_delivery_backoff_seconds",
            "Seconds the pager waits before its next try while no Alertmanager accepts; 0 when delivering.",
            registry=self._general,
        )
        self.alert_failures = Gauge(
            "kvcanary_alert_delivery_failures",
            "Delivery rounds in a row in which no Alertmanager accepted what was due.",
            registry=self._general,
        )
        self.node_pool = Gauge(
            "kvcanary_node_kv_pool_tokens",
            "KV pool capacity a node reported at its last capacity audit.",
            ["target", "node", "pool"],
            registry=self._general,
        )
        self.node_window = Gauge(
            "kvcanary_node_context_window_tokens",
            "Context window a node advertised at its last capacity audit.",
            ["target", "node"],
            registry=self._general,
        )
        self.node_kv_checksum = Gauge(
            "kvcanary_node_kv_transfer_checksum_enabled",
            "1 when a prefill or decode node said at its last capacity audit that it checksums its KV "
            "hand-offs, 0 when it said it does not.",
            ["target", "node"],
            registry=self._general,
        )
        self._node_pools: dict[tuple[str, str], set[str]] = {}
        self.reload_ok = Gauge(
            "kvcanary_config_last_reload_successful",
            "1 when the last configuration reload (SIGHUP, POST /-/reload) succeeded, else 0.",
            registry=self._general,
        )
        self.reload_ok_at = Gauge(
            "kvcanary_config_last_reload_success_timestamp_seconds",
            "Unix time of the last successful configuration load (the start, or a reload).",
            registry=self._general,
        )
        self.reload_ok.set(1)
        self.reload_ok_at.set(time.time())
        self.traffic_records = Counter(
            "kvcanary_traffic_records_total",
            "Gateway traffic records judged, by target, check (marker, tokens, capacity, overlap), verdict.",
            ["target", "check", "verdict"],
            registry=self._general,
        )
        self.traffic_refused = Counter(
            "kvcanary_traffic_refused_total",
            "Requests a gateway refused before any upstream call, by target and what refused them "
            "(admission: the prompt surely over every pool of its group; quarantine).",
            ["target", "by"],
            registry=self._general,
        )
        self.traffic_unmatched = Counter(
            "kvcanary_traffic_unmatched_records_total",
            "Gateway traffic records whose api_base is no configured target's or node's, by gateway.",
            ["gateway"],
            registry=self._general,
        )
        #: Verdicts' OpenTelemetry events not sent (monitor/otel.py), by why; 0 without `otel:`.
        self.otel_dropped = Counter(
            "kvcanary_otel_events_dropped_total",
            "Verdicts' OpenTelemetry evaluation events dropped: the queue was full (queue_full) or the "
            "collector did not take them (export_failed).",
            ["reason"],
            registry=self._general,
        )
        for reason in ("queue_full", "export_failed"):
            self.otel_dropped.labels(reason)
        self.traffic_dropped = Counter(
            "kvcanary_traffic_tap_dropped_records_total",
            "Records a gateway's tap reported it dropped (the monitor was down, slow or refused them).",
            ["gateway"],
            registry=self._general,
        )
        # The tally is the process's (the HTTP ingest and the stream's reader threads add to it).
        self._general.register(VersionRefusalsCollector(REFUSED_VERSIONS.counts))
        self.schedule_lag = Histogram(
            "kvcanary_schedule_lag_seconds",
            "Seconds from when a scheduled run was due to when it started (after waiting for a slot).",
            buckets=LAG_BUCKETS,
            registry=self._general,
        )

    def declare(self, target: str, intervals: Mapping[str, float]) -> None:
        """Export zeros for every series known in advance, so rate() and absent() behave."""
        self.pairs.declare(target, intervals)
        for probe in intervals:
            self.probe_duration.labels(probe)

    def forget_removed(self, target: str) -> None:
        """Drop what a target keeps across changes of its settings, once a reload removed it."""
        for change in ("joined", "left"):
            with contextlib.suppress(KeyError):
                self.gateway_node_changes.remove(target, change)

    def forget(self, target: str, kinds: Iterable[str] | None = None) -> None:
        """Drop the series of a target (or some of its kinds) a reload removed, node facts included."""
        self.pairs.forget(target, kinds)
        if kinds is None:
            self.paths.forget(target)
            self.nodes.forget(target)
            self.paths_unprobed.forget(target)
        if kinds is None or "capacity" in kinds:
            for t, node in [key for key in self._node_pools if key[0] == target]:
                for pool in self._node_pools.pop((t, node)):
                    self.node_pool.remove(t, node, pool)
                with contextlib.suppress(KeyError):
                    self.node_window.remove(t, node)
                with contextlib.suppress(KeyError):
                    self.node_kv_checksum.remove(t, node)

    def watch_incidents(
        self, counts: OpenIncidentCounts, pairs: Pairs, writes: WriteHealth | None = None
    ) -> None:
        self._incidents = OpenIncidentsCollector(counts, pairs, writes)
        self.registry.register(self._incidents)

    def watch_spool(self, spool: Spool) -> None:
        self._general.register(SpoolCollector(spool))

    def watch_replicas(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._general.register(ReplicaCollector(counts))

    def watch_slots(self, counts: Callable[[], tuple[int, int, int, int]]) -> None:
        self._general.register(SlotsCollector(counts))

    def watch_outbox(self, backlog: Callable[[], tuple[int, float]]) -> None:
        self._general.register(OutboxCollector(backlog))

    def watch_containment(
        self,
        targets: Callable[[], Iterable[str]],
        quarantined: Quarantined,
        report: Callable[[], ContainmentReport] = ContainmentReport,
    ) -> None:
        """Export the quarantine set and, from ``report``, the reads, modes, foreign values and key
        (``monitor/metrics/containment.py``)."""
        self._general.register(QuarantineCollector(targets, quarantined, report))

    def watch_gateways(
        self,
        health: GatewayHealth,
        circuits: GatewayCircuits,
        reads: Callable[[], GatewayReads | None] = lambda: None,
        untrusted: UntrustedPools = dict,
    ) -> None:
        self._general.register(GatewayHealthCollector(health, circuits, reads))
        self._general.register(UntrustedPoolsCollector(untrusted))

    def watch_stream(self, report: Callable[[], dict[str, Any]]) -> None:
        self._general.register(StreamCollector(report))

    def declare_alertmanagers(self, urls: Iterable[str]) -> None:
        for url in urls:
            for outcome in DELIVERY_OUTCOMES:
                self.alert_deliveries.labels(url, outcome)

    def observe(
        self,
        target: str,
        probe: str,
        result: ProbeResult,
        duration: float,
        finished_at: float,
        node: str = "",
    ) -> None:
        tokens = {
            kind: spent
            for kind in TOKEN_KINDS
            if (spent := result.measurements.get(f"{kind}_tokens_spent", 0)) > 0
        }
        self.pairs.observe(target, probe, result.verdict.value, duration, finished_at, tokens)
        self.probe_duration.labels(probe).observe(duration)
        if probe == "capacity":
            self._node_capacity(target, node, result)

    def _node_capacity(self, target: str, node: str, result: ProbeResult) -> None:
        """Export what the node's capacity audit read (``context_window_tokens``, ``pool_tokens.<pool>``,
        ``kv_transfer_checksum_enabled``) and only that: a pool it no longer publishes is dropped, so
        an engine naming new pools at every audit cannot grow series (the names are bounded per node
        where they are read). A node that could not be asked (unreachable, timeout) keeps its last
        figures: alerts on them hold."""
        measurements = result.measurements
        published = "context_window_tokens" in measurements
        if not published and result.reason != "capacity_unknown":
            return
        pools = {
            key.removeprefix("pool_tokens."): value
            for key, value in measurements.items()
            if key.startswith("pool_tokens.")
        }
        for gone in self._node_pools.pop((target, node), set()) - set(pools):
            self.node_pool.remove(target, node, gone)
        for pool, value in pools.items():
            self.node_pool.labels(target, node, pool).set(value)
        self._node_pools[(target, node)] = set(pools)
        if published:
            self.node_window.labels(target, node).set(measurements["context_window_tokens"])
        else:
            with contextlib.suppress(KeyError):
                self.node_window.remove(target, node)
        # Only a node that says whether it checksums its hand-offs has the series.
        if (checksum := measurements.get("kv_transfer_checksum_enabled")) is not None:
            self.node_kv_checksum.labels(target, node).set(checksum)
        else:
            with contextlib.suppress(KeyError):
                self.node_kv_checksum.remove(target, node)

    def exposition(self) -> bytes:
        """Return the whole page ``/metrics`` serves, in the text format (version 0.0.4)."""
        parts = [generate_latest(self._general).decode(), self.pairs.render()]
        if self._incidents is not None:
            parts.append(self._incidents.render())
        return "".join(parts).encode()
