"""What SGLang's model gateway says of the nodes it routes to, as kvcanary last read it
(``monitor/runs/discovery.py``): ``kvcanary_gateway_worker_healthy{target,node}`` is 1 while the
gateway lists the node as healthy (it sends customers there), 0 while it does not; and, where the
target names the gateway's metrics page, ``kvcanary_gateway_worker_circuit_state{target,node}`` is
its circuit breaker for the node (0 closed, 1 open, 2 half-open). Beside the probes' verdicts this
shows the failure health checks cannot see: a node the gateway keeps healthy, its breaker closed,
and routes to, while its paths leak (sglang#32652: a decode control-path failure invisible to them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Each gateway target's node health at the last reading: {target: {node: healthy}}.
GatewayHealth = Callable[[], Mapping[str, Mapping[str, bool]]]


#: Each gateway target's circuit-breaker state by node at the last reading: {target: {node: state}}.
GatewayCircuits = Callable[[], Mapping[str, Mapping[str, int]]]


class GatewayHealthCollector(Collector):
    def __init__(self, health: GatewayHealth, circuits: GatewayCircuits = dict):
        self._health = health
        self._circuits = circuits

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
        circuits = GaugeMetricFamily(
            "kvcanary_gateway_worker_circuit_state",
            "The target's SGLang gateway's circuit breaker for the node: 0 closed, 1 open (the gateway "
            "sends it nothing), 2 half-open; as kvcanary last read smg_worker_cb_state on its metrics page.",
            labels=["target", "node"],
        )
        for target, states in sorted(self._circuits().items()):
            for node, state in sorted(states.items()):
                circuits.add_metric([target, node], float(state))
        yield circuits
