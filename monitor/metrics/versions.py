"""Records refused for their tap protocol version: ``kvcanary_traffic_version_refused_records_total``
``{transport, version}``, read at each scrape from the process's tally
(``monitor/traffic/schema.py``'s ``REFUSED_VERSIONS``), which the HTTP ingest and the stream's
consumer both add to. A tap of another version than the monitor's prints text otherwise, so its
records are never judged; above 0, a gateway's tap needs upgrading (or the monitor)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

#: Records refused so far, by (transport, version label).
Refusals = Callable[[], Mapping[tuple[str, str], int]]


class VersionRefusalsCollector(Collector):
    def __init__(self, refusals: Refusals):
        self._refusals = refusals

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvcanary_traffic_version_refused_records",
            "Gateway traffic records refused, never judged, for their tap protocol version, by transport "
            "(http: a 400; nats: acknowledged and dropped) and the version sent (none: a tap before "
            "version 4).",
            labels=["transport", "version"],
        )
        for (transport, version), count in sorted(self._refusals().items()):
            family.add_metric([transport, version], float(count))
        yield family
