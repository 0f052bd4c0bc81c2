"""The traffic stream's series (``traffic.source: jetstream``), read from the consumer's report at
each scrape: is this replica connected, how many share the partitions, what it has taken, and how
far behind the stream it is, and which partitions it consumes: a partition no replica consumes
(``sum`` of ``..._partition_consuming`` below ``..._partitions``) is traffic nobody judges; and
what it read in the partitions' bucket that no replica wrote (``bucket_anomalies``: a rogue
writer). Each replica exports its own; sum ``records_total`` across them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: The bucket anomalies metric's kinds, what ``traffic/partitions.py``'s ``Partitions.anomalies``
#: counts: every kind is exported, 0 where none was seen.
ANOMALIES = ("replicas_over_limit", "claims_without_heartbeat", "partitions_withheld")
#: The report's counts and the ``outcome`` label each is exported under.
OUTCOMES = {"judged": "judged", "duplicates": "duplicate", "rejected": "rejected", "misrouted": "misrouted"}


class StreamCollector(Collector):
    def __init__(self, report: Callable[[], dict[str, Any]]):
        self._report = report

    def collect(self) -> Iterator[Metric]:
        report = self._report()
        yield from _partitions(report)
        yield _anomalies(report)
        yield from _progress(report)


def _partitions(report: dict[str, Any]) -> Iterator[Metric]:
    """Whether this replica is connected, how many share the partitions, and which it consumes."""
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
    count = int(report.get("partition_count", 0))
    yield GaugeMetricFamily(
        "kvcanary_traffic_stream_partitions",
        "Partitions of the traffic stream (traffic.jetstream.partitions), every replica's to share.",
        value=count,
    )
    consuming = set(report.get("consuming", []))
    family = GaugeMetricFamily(
        "kvcanary_traffic_stream_partition_consuming",
        "1 while this replica consumes the partition (holds its claim, is connected, and its "
        "consumer is on the server), else 0 (another replica's, or nobody's).",
        labels=["partition"],
    )
    for n in range(count):
        family.add_metric([str(n)], 1.0 if n in consuming else 0.0)
    yield family


def _anomalies(report: dict[str, Any]) -> Metric:
    """What the last step read in the partitions' bucket that no replica wrote, every kind."""
    found = report.get("bucket_anomalies", {})
    anomalies = GaugeMetricFamily(
        "kvcanary_traffic_stream_bucket_anomalies",
        "What this replica's last step read in the partitions' KV bucket that no set of real replicas "
        "writes, by kind: replicas_over_limit (live heartbeats beyond traffic.jetstream.max_replicas), "
        "claims_without_heartbeat (partitions claimed by a replica with no heartbeat), "
        "partitions_withheld (partitions this replica is to consume that another has held over a "
        "lease). Above 0: something other than the monitors writes the bucket.",
        labels=["kind"],
    )
    for kind in ANOMALIES:
        anomalies.add_metric([kind], float(found.get(kind, 0)))
    return anomalies


def _progress(report: dict[str, Any]) -> Iterator[Metric]:
    """What this replica took from the stream, and how far behind it is."""
    records = CounterMetricFamily(
        "kvcanary_traffic_stream_records",
        "Records this replica took from the traffic stream since it started, by outcome: judged; "
        "duplicate (delivered again, judged before: acknowledged, not judged twice); rejected "
        "(no valid record); misrouted (its api_base hashes to another partition than the one it "
        "came on: acknowledged, not judged).",
        labels=["outcome"],
    )
    for key, outcome in OUTCOMES.items():
        records.add_metric([outcome], report.get(key, 0))
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
