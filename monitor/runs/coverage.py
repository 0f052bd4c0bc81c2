"""What one run of a probe kind covers, and so which (target, kind, node) keys the configuration
runs: each node for a node-scoped kind; else the target itself, and each prefill x decode path when
the kind is one of the target's path kinds (``path_probes``). The runner and ``kvcanary check``
both run what this says; the runner's states and the metrics' series are keyed by it.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.probes import REGISTRY
from kvcanary.probes.target import Node, ServingPath, TargetClient

log = logging.getLogger("kvcanary.runner")


class RunKey(NamedTuple):
    """One (target, kind, node) the configuration runs; ``node`` is "" for a target-wide run."""

    target: str
    kind: str
    node: str


#: What one run of a kind covers: a node, a prefill x decode path, or the whole target (None).
Where = Node | ServingPath | None


def nodes_of_run(target: TargetConfig, kind: str) -> list[Where]:
    """Return what one run of ``kind`` covers: each node for a node-scoped kind; else the target
    (None), and each prefill x decode path when it is one of the target's path kinds."""
    if REGISTRY[kind].scope == "node":
        return list(target.node_list())
    if kind in target.path_kinds():
        return [None, *target.paths()]
    return [None]


def bound_to(client: TargetClient, where: Where) -> tuple[TargetClient, Node | None]:
    """Return the client and node a run covering ``where`` uses: down a path, the path's own client."""
    if isinstance(where, ServingPath):
        return client.via(where), None
    return client, where


def declare_coverage(metrics: MonitorMetrics, target: TargetConfig) -> None:
    """Export the coverage series of ``target``'s paths (none when it runs no kind down them) and
    nodes (none when it runs no node-scoped kind)."""
    now = time.time()
    kinds = target.path_kinds()
    paths = [(p.prefill_name, p.decode_name) for p in target.paths()] if kinds else []
    interval = min((target.interval_for(kind) for kind in kinds), default=0.0)
    metrics.paths.declare(target.name, paths, interval, now)
    _declare_unprobed(metrics, target, kinds)
    node_kinds = [kind for kind in target.probes if REGISTRY[kind].scope == "node"]
    nodes = [node.name for node in target.node_list()] if node_kinds else []
    interval = min((target.interval_for(kind) for kind in node_kinds), default=0.0)
    metrics.nodes.declare(target.name, nodes, interval, now)


def _declare_unprobed(metrics: MonitorMetrics, target: TargetConfig, kinds: list[str]) -> None:
    """Export the pairs of the target's nodes no path run goes down (none where it runs no path
    kind or probes no pair); log a count when it changes (reloads re-declare every target)."""
    counts = target.unprobed_paths() if kinds else {}
    for reason, pairs in metrics.paths_unprobed.declare(target.name, counts).items():
        if pairs:
            log.warning("%s: %d prefill x decode pair(s) not probed (%s): the gateway may send customers "
                        "down them unchecked", target.name, pairs, reason)  # fmt: skip


def run_keys(settings: Settings) -> list[RunKey]:
    """Return every (target, kind, node) the configuration runs."""
    return [
        RunKey(t.name, kind, node.name if node else "")
        for t in settings.targets
        for kind in t.probes
        for node in nodes_of_run(t, kind)
    ]
