"""Containment's series (``monitor/containment/``), read at each scrape from what the last sync of the
set and the replica's own counts left:

- ``kvcanary_target_quarantined{target}`` is 1 while the gateways are told to stop sending
  customers to it, and ``kvcanary_target_quarantine_observed{target}`` 1 while the ``observe``
  policy only records that it would be; every configured target has both, 0 when it is neither;
- ``kvcanary_target_containment_mode{target,mode}``: 1 for each target's policy (``observe``,
  ``quarantine``): a target in ``quarantine`` that no gateway reads the set for is unprotected;
- ``kvcanary_quarantine_set_reads_total{gateway,via}`` and
  ``kvcanary_quarantine_set_last_read_timestamp_seconds{gateway,key_id}``: the gateways' reads of
  the set this replica saw (``via`` http: its GETs; nats: the taps' acknowledgements), and when
  each last read it, by the key of the set it held then (what it applies: after a key rotation,
  which gateways follow the new key);
- ``kvcanary_quarantine_bucket_foreign_total{reason}``: values the monitors did not put, found in
  the bucket and put right;
- ``kvcanary_quarantine_signing_key_info{key_id}``: 1 for the key this replica signs with (none
  without a key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: (target, enforced) of each quarantined target.
Quarantined = Callable[[], Iterable[tuple[str, bool]]]


@dataclass(frozen=True)
class ContainmentReport:
    """What the containment says of itself at a scrape (``Containment.report``)."""

    modes: dict[str, str] = field(default_factory=dict)  # target: observe | quarantine
    reads: dict[tuple[str, str], int] = field(default_factory=dict)  # (gateway, via): reads
    last_reads: dict[tuple[str, str], float] = field(default_factory=dict)  # (gateway, key id): epoch
    foreign: dict[str, int] = field(default_factory=dict)  # reason: values
    key_id: str | None = None


class QuarantineCollector(Collector):
    def __init__(
        self,
        targets: Callable[[], Iterable[str]],
        quarantined: Quarantined,
        report: Callable[[], ContainmentReport] = ContainmentReport,
    ):
        self._targets = targets
        self._quarantined = quarantined
        self._report = report

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
        yield from _of(self._report())


def _of(report: ContainmentReport) -> Iterator[Metric]:
    modes = GaugeMetricFamily(
        "kvcanary_target_containment_mode",
        "1 for the target's containment mode (observe, quarantine).",
        labels=["target", "mode"],
    )
    for target, mode in sorted(report.modes.items()):
        modes.add_metric([target, mode], 1.0)
    reads = CounterMetricFamily(
        "kvcanary_quarantine_set_reads",
        "Reads of the quarantine set by gateway this replica saw: GETs (via http), the taps' "
        "acknowledgements of the set they apply (via nats).",
        labels=["gateway", "via"],
    )
    for (gateway, via), count in sorted(report.reads.items()):
        reads.add_metric([gateway, via], count)
    last = GaugeMetricFamily(
        "kvcanary_quarantine_set_last_read_timestamp_seconds",
        "When each gateway last read (or acknowledged) the quarantine set, by the key of the set it held "
        "then, as this replica saw it.",
        labels=["gateway", "key_id"],
    )
    for (gateway, key), at in sorted(report.last_reads.items()):
        last.add_metric([gateway, key], at)
    foreign = CounterMetricFamily(
        "kvcanary_quarantine_bucket_foreign",
        "Values found in the quarantine set's bucket that the monitors did not put (unsigned, an unknown "
        "key, a bad signature, not a set, an older set put back), by reason; each was put right.",
        labels=["reason"],
    )
    for reason, count in sorted(report.foreign.items()):
        foreign.add_metric([reason], count)
    signing = GaugeMetricFamily(
        "kvcanary_quarantine_signing_key_info",
        "1 for the key this replica signs the quarantine set with (no series: no key, no set served).",
        labels=["key_id"],
    )
    if report.key_id is not None:
        signing.add_metric([report.key_id], 1.0)
    yield from (modes, reads, last, foreign, signing)
