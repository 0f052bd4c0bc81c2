"""What SGLang's model gateway says of the nodes it routes to, as kvcanary last read it
(``monitor/runs/discovery.py``): ``kvcanary_gateway_worker_healthy{target,node}`` is 1 while the
gateway lists the node as healthy (it sends customers there), 0 while it does not. Beside the
probes' verdicts this shows the failure health checks cannot see: a node the gateway keeps healthy,
and routes to, while its paths leak (sglang#32652: a decode control-path failure invisible to them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Each gateway target's node health at the last reading: {target: {node: healthy}}.
GatewayHealth = Callable[[], Mapping[str, Mapping[str, bool]]]


class GatewayHealthCollector(Collector):
    def __init__(self, health: GatewayHealth):
        self._health = health

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvcanary_gateway_worker_healthy",
            "1 while the target's SGLang gateway lists the node as healthy (it routes customers there), "
            "0 while it does not; as kvcanary last read GET /workers.",
            labels=["target", "node"],
        )
        for target, nodes in sorted(self._health().items()):
            for node, healthy in sorted(nodes.items()):
                family.add_metric([target, node], 1.0 if healthy else 0.0)
        yield family
