"""Which targets are quarantined (``monitor/containment/rules.py``), as the last sync of the set left it:
``kvcanary_target_quarantined{target}`` is 1 while the gateways are told to stop sending customers
to it, and ``kvcanary_target_quarantine_observed{target}`` 1 while the ``observe`` policy only
records that it would be. Every configured target has both series, 0 when it is neither."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: (target, enforced) of each quarantined target.
Quarantined = Callable[[], Iterable[tuple[str, bool]]]


class QuarantineCollector(Collector):
    def __init__(self, targets: Callable[[], Iterable[str]], quarantined: Quarantined):
        self._targets = targets
        self._quarantined = quarantined

    def collect(self) -> Iterator[Metric]:
        found = dict(self._quarantined())
        enforced = GaugeMetricFamily(
            "kvcanary_target_quarantined",
            "1 while the gateways are told to send the target no customer request (quarantine), else 0.",
            labels=["target"],
        )
        observed = GaugeMetricFamily(
            "kvcanary_target_quarantine_observed",
            "1 while the observe policy records that the target would be quarantined, else 0.",
            labels=["target"],
        )
        for target in self._targets():
            enforced.add_metric([target], 1.0 if found.get(target) is True else 0.0)
            observed.add_metric([target], 1.0 if found.get(target) is False else 0.0)
        yield enforced
        yield observed
