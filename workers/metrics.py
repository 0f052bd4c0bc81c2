"""Every metric the worker exports, in its own CollectorRegistry (never the global one).

The names, types and labels are a stable contract documented in ``docs/worker-metrics.md``. No label
carries a request id, tenant or key: ``reason``, ``code`` and ``pool`` take a handful of values each,
and the known ones start at 0 so that ``increase()`` sees the first event. ``kvcanary_worker_info``
carries the process's fixed settings, for alert rules and dashboards to join on.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcanary.workers import __version__
from kvcanary.workers.config import WorkerConfig
from kvcanary.workers.kv_cache import PagePool

if TYPE_CHECKING:  # the collector only reads the batch's counter
    from kvcanary.workers.batch import RunningBatch

REJECTION_REASONS = ("context_window", "kv_capacity")
KNOWN_STATUS_CODES = ("200", "400", "401", "404", "500")
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INFO_LABELS = ("version", "mode", "admission", "verify_ownership", "zero_freed_pages", "prefix_cache")


class WorkerMetrics:
    """The worker's counters, gauges and histogram, registered in ``self.registry``.

    Example::

        metrics = WorkerMetrics()
        metrics.admission_rejections.labels(reason="kv_capacity").inc()
        text = metrics.render()
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._engines: EngineCollector | None = None  # registered with the first engine watched
        r = self.registry
        self.ownership_violations = Counter(
            "kvcanary_kv_ownership_violations",
            "Decode reads refused because a page was not owned or not filled by the reading request.",
            registry=r,
        )
        self.admission_rejections = Counter(
            "kvcanary_admission_rejections",
            "Requests refused at admission with HTTP 400.",
            ["reason"],
            registry=r,
        )
        self.placeholder_substitutions = Counter(
            "kvcanary_placeholder_substitutions",
            "Over-capacity requests replaced by a one-token placeholder (--admission placeholder).",
            registry=r,
        )
        # Only a worker started with --bug moves these (labelled by the bug's name).
        self.bug_trigger_events = Counter(
            "kvcanary_bug_trigger_events",
            "Trigger events of a --bug defect (it fired or not).",
            ["bug"],
            registry=r,
        )
        self.bug_fired = Counter(
            "kvcanary_bug_fired", "Trigger events a --bug defect acted on.", ["bug"], registry=r
        )
        self.requests_aborted = Counter(
            "kvcanary_requests_aborted",
            "Requests whose client went away before their answer was complete.",
            registry=r,
        )
        self.requests = Counter(
            "kvcanary_requests",
            "Completion and chat requests answered, by HTTP status.",
            ["code"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "kvcanary_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.context_window = Gauge(
            "kvcanary_context_window_tokens", "Advertised context window in tokens.", registry=r
        )
        self.prefix_cache_queries = Counter(
            "kvcanary_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (0 with --prefix-cache off).",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "kvcanary_prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=r
        )
        # Only the prefill and decode servers (--mode prefill/decode) move these: SGLang's PD transfer
        # and bootstrap failures, as seen from each side of the hand-off (workers.pd_transfer).
        self.kv_transfer_failures = Counter(
            "kvcanary_kv_transfer_failures",
            "KV hand-offs between a prefill and a decode server that failed, by the side that saw it.",
            ["side"],
            registry=r,
        )
        # Only a decode server with --kv-checksum moves this: hand-offs whose K/V did not match the
        # prefill server's digest (each also counted above, side="decode", as SGLang counts a checksum
        # mismatch among its transfer failures).
        self.kv_transfer_checksum_failures = Counter(
            "kvcanary_kv_transfer_checksum_failures",
            "KV hand-offs whose K/V did not match the prefill server's Adler-32 digest (--kv-checksum).",
            registry=r,
        )
        self.cached_tokens_by_tier = Counter(
            "kvcanary_cached_tokens_by_tier",
            "Prompt tokens served from a cache, by the tier that served them (prefix, session, offload).",
            ["tier"],
            registry=r,
        )
        self.worker_info = Gauge(
            "kvcanary_worker_info",
            "Always 1; the labels are the worker's version and the isolation settings in force.",
            INFO_LABELS,
            registry=r,
        )
        self._start_known_labels()

    def _start_known_labels(self) -> None:
        """Export the known label values at 0, so that ``increase()`` sees their first event."""
        for reason in REJECTION_REASONS:
            self.admission_rejections.labels(reason=reason)
        for code in KNOWN_STATUS_CODES:
            self.requests.labels(code=code)
        for side in ("prefill", "decode"):
            self.kv_transfer_failures.labels(side=side)

    def describe(self, config: WorkerConfig) -> None:
        """Export the constants of ``config``: the context window, ``kvcanary_worker_info``, and its
        cache tiers at 0."""
        self.context_window.set(config.context_window)
        for tier in config.cache_tiers:
            self.cached_tokens_by_tier.labels(tier=tier)
        self.worker_info.labels(
            version=__version__,
            mode=config.mode,
            admission=config.effective_admission,
            verify_ownership=str(config.verify_ownership).lower(),
            zero_freed_pages=str(config.zero_freed_pages).lower(),
            prefix_cache=config.prefix_cache,
        ).set(1)

    def watch_engine(self, pools: Mapping[str, PagePool], batch: RunningBatch) -> None:
        """Export the page counters, pool gauges and ownership checks of an engine (read at scrape
        time); a server's data-parallel ranks (``workers.dp``) each call this, in rank order."""
        if self._engines is None:
            self._engines = EngineCollector()
            self.registry.register(self._engines)
        self._engines.add(pools, batch)

    def render(self) -> bytes:
        """Return the registry in the Prometheus text format."""
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Read the pools' and the batch's own counters at scrape time.

    The allocator and the decode loop stay free of metrics code: a prometheus-client ``inc`` takes a
    lock, and in the decode loop that alone cost a tenth of a percent of throughput on a CPU.
    """

    def __init__(self) -> None:
        self._ranks: list[tuple[dict[str, PagePool], RunningBatch]] = []

    def add(self, pools: Mapping[str, PagePool], batch: RunningBatch) -> None:
        """Watch one more engine: the next data-parallel rank."""
        self._ranks.append((dict(pools), batch))

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        pools = [pool for ranked, _ in self._ranks for pool in ranked.values()]
        yield CounterMetricFamily(
            "kvcanary_kv_ownership_checks",
            "Block-table entries verified before a decode read, and prefill pages before a transfer "
            "that the prefix cache may share (--verify-ownership).",
            value=sum(batch.entries_checked for _, batch in self._ranks),
        )
        yield CounterMetricFamily(
            "kvcanary_kv_pages_allocated",
            "KV pages handed out by the allocators (all pools).",
            value=sum(pool.pages_allocated for pool in pools),
        )
        yield CounterMetricFamily(
            "kvcanary_kv_pages_reused_dirty",
            "KV pages allocated while still holding another request's data (all pools).",
            value=sum(pool.pages_reused_dirty for pool in pools),
        )
        # A server with data-parallel ranks labels each rank's pools with it (``dp_rank``), as
        # SGLang labels its schedulers' gauges; one rank keeps the plain series.
        labels = ["pool", "dp_rank"] if len(self._ranks) > 1 else ["pool"]
        capacity = GaugeMetricFamily("kvcanary_kv_pool_tokens", "KV pool capacity in tokens.", labels=labels)
        free = GaugeMetricFamily("kvcanary_kv_pages_free", "KV pages free right now.", labels=labels)
        for rank, (ranked, _) in enumerate(self._ranks):
            for name, pool in ranked.items():
                values = [name, str(rank)][: len(labels)]
                capacity.add_metric(values, pool.capacity_tokens)
                free.add_metric(values, pool.free_pages)
        yield capacity
        yield free
