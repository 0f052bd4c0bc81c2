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
        yield _by_node(
            "kvcanary_gateway_worker_healthy",
            "1 while the target's SGLang gateway lists the node as healthy (it routes customers there), "
            "0 while it does not; as kvcanary last read GET /workers.",
            self._health(),
        )
        yield _by_node(
            "kvcanary_gateway_worker_circuit_state",
            "The target's SGLang gateway's circuit breaker for the node: 0 closed, 1 open (the gateway "
            "sends it nothing), 2 half-open; as kvcanary last read smg_worker_cb_state on its metrics page.",
            self._circuits(),
        )


def _by_node(name: str, documentation: str, values: Mapping[str, Mapping[str, float]]) -> Metric:
    """One gauge family of {target: {node: value}} (a bool as 1 or 0), in a stable order."""
    family = GaugeMetricFamily(name, documentation, labels=["target", "node"])
    for target, nodes in sorted(values.items()):
        for node, value in sorted(nodes.items()):
            family.add_metric([target, node], float(value))
    return family
