"""The traffic stream's series (``traffic.source: jetstream``), read from the consumer's report at
each scrape: is this replica connected, how many share the partitions, what it has taken, and how
far behind the stream it is. Each replica exports its own; sum ``records_total`` across them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: The report's counts and the ``outcome`` label each is exported under.
OUTCOMES = {"judged": "judged", "duplicates": "duplicate", "rejected": "rejected"}


class StreamCollector(Collector):
    def __init__(self, report: Callable[[], dict[str, Any]]):
        self._report = report

    def collect(self) -> Iterator[Metric]:
        report = self._report()
        yield GaugeMetricFamily(
            "kvcanary_traffic_stream_connected",
            "1 while this replica is connected to NATS for the traffic stream, else 0.",
            value=1.0 if report["connected"] else 0.0,
        )
        yield GaugeMetricFamily(
            "kvcanary_traffic_stream_replicas",
            "Replicas sharing the traffic stream's partitions (live leases in the KV bucket).",
            value=report["replicas"],
        )
        yield GaugeMetricFamily(
            "kvcanary_traffic_stream_partitions_held",
            "Partitions of the traffic stream this replica consumes now.",
            value=len(report["partitions"]),
        )
        records = CounterMetricFamily(
            "kvcanary_traffic_stream_records",
            "Records this replica took from the traffic stream since it started, by outcome: judged; "
            "duplicate (delivered again, judged before: acknowledged, not judged twice); rejected "
            "(no valid record).",
            labels=["outcome"],
        )
        for key, outcome in OUTCOMES.items():
            records.add_metric([outcome], report[key])
        yield records
        yield GaugeMetricFamily(
            "kvcanary_traffic_stream_pending_messages",
            "Messages waiting in this replica's partitions behind its last pull (JetStream's count; "
            "each carries a tap batch's records of one partition).",
            value=report["pending_messages"],
        )
        yield GaugeMetricFamily(
            "kvcanary_traffic_stream_lag_seconds",
            "How long the newest record of this replica's last pull had waited in the stream when "
            "pulled, the most over its partitions; 0 once a pull finds nothing waiting.",
            value=report["lag_seconds"],
        )
