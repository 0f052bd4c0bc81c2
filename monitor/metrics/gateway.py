"""What SGLang's model gateway says of the nodes it routes to, as kvcanary last read it
(``monitor/runs/discovery.py``): ``kvcanary_gateway_worker_healthy{target,node}`` is 1 while the
gateway lists the node as healthy (it sends customers there), 0 while it does not; and, where the
target names the gateway's metrics page, ``kvcanary_gateway_worker_circuit_state{target,node}`` is
its circuit breaker for the node (0 closed, 1 open, 2 half-open). Beside the probes' verdicts this
shows the failure health checks cannot see: a node the gateway keeps healthy, its breaker closed,
and routes to, while its paths leak (sglang#32652: a decode control-path failure invisible to them).

What discovery could not take at the gateway's word: ``kvcanary_gateway_read_errors_total{target,
node,read}`` counts the reads that failed (``node`` empty for the gateway's own pages, ``workers``
and ``metrics``; a node's ``server_info`` and ``models`` read when it joins), and
``kvcanary_gateway_workers_refused{target,reason}`` the workers the last listing named that are no
nodes (``type``, ``url``, ``cut``, ``unreadable``: ``targets/sglang_gateway.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Each gateway target's node health at the last reading: {target: {node: healthy}}.
GatewayHealth = Callable[[], Mapping[str, Mapping[str, bool]]]


#: Each gateway target's circuit-breaker state by node at the last reading: {target: {node: state}}.
GatewayCircuits = Callable[[], Mapping[str, Mapping[str, int]]]


class GatewayReads(Protocol):
    """What discovery could not take at the gateways' word (``monitor/runs/discovery.py``)."""

    @property
    def failures(self) -> Mapping[tuple[str, str, str], int]:
        """Failed reads by (target, node, read)."""

    @property
    def refused(self) -> Mapping[str, Mapping[str, int]]:
        """Workers the last listing named that are no nodes: {target: {reason: workers}}."""


class GatewayHealthCollector(Collector):
    def __init__(
        self,
        health: GatewayHealth,
        circuits: GatewayCircuits = dict,
        reads: Callable[[], GatewayReads | None] = lambda: None,
    ):
        self._health = health
        self._circuits = circuits
        self._reads = reads

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
        reads = self._reads()
        errors = CounterMetricFamily(
            "kvcanary_gateway_read_errors",
            "Reads of a target's SGLang gateway (node empty: its worker list, read=workers, or metrics "
            "page, read=metrics) or of a node it lists (read=server_info or models, when the node "
            "joins) that failed: no answer within the read's bound, no connection, or an answer "
            "that is not what it claims.",
            labels=["target", "node", "read"],
        )
        for (target, node, read), count in sorted(reads.failures.items() if reads else ()):
            errors.add_metric([target, node, read], float(count))
        yield errors
        refused = GaugeMetricFamily(
            "kvcanary_gateway_workers_refused",
            "Workers the target's SGLang gateway listed at its last reading that kvcanary did not take "
            "as nodes, by why: type (no worker type it knows), url (a URL no engine can have), cut "
            "(past 1,000 workers), unreadable.",
            labels=["target", "reason"],
        )
        for target, reasons in sorted(reads.refused.items() if reads else ()):
            for reason, workers in sorted(reasons.items()):
                refused.add_metric([target, reason], float(workers))
        yield refused


def _by_node(name: str, documentation: str, values: Mapping[str, Mapping[str, float]]) -> Metric:
    """One gauge family of {target: {node: value}} (a bool as 1 or 0), in a stable order."""
    family = GaugeMetricFamily(name, documentation, labels=["target", "node"])
    for target, nodes in sorted(values.items()):
        for node, value in sorted(nodes.items()):
            family.add_metric([target, node], float(value))
    return family
