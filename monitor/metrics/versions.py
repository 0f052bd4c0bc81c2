"""Records refused for their tap protocol version: ``kvcanary_traffic_version_refused_records_total``
``{transport, version}``, read at each scrape from the process's tally (:data:`REFUSED_VERSIONS`),
which the HTTP ingest and the stream's consumer both add to (``monitor/traffic/schema.py``'s
``UnspokenVersion`` is what they refuse). A tap of another version than the monitor's prints text
otherwise, so its records are never judged; above 0, a gateway's tap needs upgrading (or the
monitor)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kvcanary.traffic")


class Refusal(Protocol):
    """A batch or message refused for its version (``traffic.schema.UnspokenVersion``): its version's
    label and how many records it held; ``str()`` says why."""

    version: str
    records: int


class VersionRefusals:
    """Records refused for their protocol version since this process started, by transport
    (``http``, ``nats``) and version label. Thread-safe (messages are read on reader threads);
    each (transport, version) is logged at most once a minute."""

    LOG_SECONDS = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._logged: dict[tuple[str, str], float] = {}

    def add(self, transport: str, refusal: Refusal) -> None:
        """Count ``refusal``'s records (at least one) under ``transport``, and say it."""
        key = (transport, refusal.version)
        now = time.monotonic()
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + max(refusal.records, 1)
            due = now - self._logged.get(key, -self.LOG_SECONDS) >= self.LOG_SECONDS
            if due:
                self._logged[key] = now
        if due:
            log.warning("traffic: refused %d record(s) over %s: %s", refusal.records, transport, refusal)

    def counts(self) -> dict[tuple[str, str], int]:
        """Return the records refused so far, by (transport, version)."""
        with self._lock:
            return dict(self._counts)


#: This process's refusals by version, the HTTP ingest's and the stream consumer's.
REFUSED_VERSIONS = VersionRefusals()

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
