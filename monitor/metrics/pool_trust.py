"""The KV pool readings the monitor does not trust (``monitor/traffic/facts.py``):
``kvcanary_node_pool_untrusted{target,node,reason}`` is 1 for each node whose last pool reading is
not believed, by why (``below_floor``, ``below_own_input_limit``, ``moved``), and absent once one
is. Such a reading guards nothing and judges nothing; ``KVCanaryNodePoolUntrusted`` pages on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: The readings not trusted now: {(target, node): reason} (node empty: the target's own reading).
UntrustedPools = Callable[[], Mapping[tuple[str, str], str]]


class UntrustedPoolsCollector(Collector):
    def __init__(self, untrusted: UntrustedPools = dict):
        self._untrusted = untrusted

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvcanary_node_pool_untrusted",
            "1 while the node's last KV pool reading is not trusted, by why: below_floor (under 256 "
            "tokens), below_own_input_limit (under the longest prompt the node says it admits), moved "
            "(4x from its last trusted pool with no configuration change seen). It guards nothing.",
            labels=["target", "node", "reason"],
        )
        for (target, node), reason in sorted(self._untrusted().items()):
            family.add_metric([target, node, reason], 1.0)
        yield family
