"""Every metric the monitor exports, in one file, on a registry of its own.

Labels are bounded: ``target`` and ``probe`` come from the config file, ``verdict`` and
``severity`` from fixed enums. ``kvcanary_incidents_open`` is read from the database at scrape
time, so it is right across restarts and across replicas that share one PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from probes.base import ProbeResult, Verdict

# ``*_created`` series double the exposition and no rule or dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

SEVERITIES = ("critical", "high", "warning")
# Probe runs range from a 20 ms canary to a boundary probe that ships millions of tokens.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

OpenIncidentCounts = Callable[[], Iterable[tuple[str, str, str, int]]]


class OpenIncidentsCollector(Collector):
    """Export ``kvcanary_incidents_open`` from ``(target, probe, severity, count)`` rows."""

    def __init__(self, counts: OpenIncidentCounts, pairs: Callable[[], Iterable[tuple[str, str]]]):
        self._counts = counts
        self._pairs = pairs

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvcanary_incidents_open",
            "Open incidents by target, probe and severity (from the database).",
            labels=["target", "probe", "severity"],
        )
        values = {(t, p, s): 0 for t, p in self._pairs() for s in SEVERITIES}
        try:
            for target, probe, severity, count in self._counts():
                values[(target, probe, severity)] = count
        except Exception:  # a database hiccup must not break the scrape; the series go stale instead
            return
        for (target, probe, severity), count in sorted(values.items()):
            family.add_metric([target, probe, severity], count)
        yield family


class MonitorMetrics:
    """The monitor's own metrics. One instance per process (tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.probe_runs = Counter(
            "kvcanary_probe_runs_total",
            "Probe runs by verdict (pass, leak, mismatch, error).",
            ["target", "probe", "verdict"],
            registry=self.registry,
        )
        self.probe_duration = Histogram(
            "kvcanary_probe_duration_seconds",
            "Wall time of one probe run.",
            ["target", "probe"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.cross_tenant_leaks = Counter(
            "kvcanary_cross_tenant_leaks_total",
            "Probe runs that saw another tenant's live marker in a response.",
            ["target"],
            registry=self.registry,
        )
        self.last_success = Gauge(
            "kvcanary_probe_last_success_timestamp_seconds",
            "Unix time of the last passing run.",
            ["target", "probe"],
            registry=self.registry,
        )
        self.last_run = Gauge(
            "kvcanary_probe_last_run_timestamp_seconds",
            "Unix time of the last run, whatever its verdict.",
            ["target", "probe"],
            registry=self.registry,
        )

    def declare(self, target: str, probes: Iterable[str]) -> None:
        """Export zeros for every series known in advance, so rate() and absent() behave."""
        self.cross_tenant_leaks.labels(target)
        for probe in probes:
            for verdict in Verdict:
                self.probe_runs.labels(target, probe, verdict.value)
            self.probe_duration.labels(target, probe)

    def watch_incidents(
        self, counts: OpenIncidentCounts, pairs: Callable[[], Iterable[tuple[str, str]]]
    ) -> None:
        self.registry.register(OpenIncidentsCollector(counts, pairs))

    def observe(
        self, target: str, probe: str, result: ProbeResult, duration: float, finished_at: float
    ) -> None:
        self.probe_runs.labels(target, probe, result.verdict.value).inc()
        self.probe_duration.labels(target, probe).observe(duration)
        self.last_run.labels(target, probe).set(finished_at)
        if result.verdict is Verdict.PASS:
            self.last_success.labels(target, probe).set(finished_at)
        if result.verdict is Verdict.LEAK:
            self.cross_tenant_leaks.labels(target).inc()
