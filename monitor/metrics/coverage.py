"""How recently each node and each prefill x decode path of a target was judged: coverage, the
figure that says a part of the fleet nobody's probes reached (a gateway's policy may never pick a
path for a probe sent through it, ``monitor/targets/paths.py``; a node may stop answering).

``kvcanary_path_last_judged_timestamp{target,prefill,decode}`` is when a run down the path last
ended in a verdict other than ``error`` (a pass, a leak, a mismatch: the output was judged);
``kvcanary_node_last_judged_timestamp{target,node}`` the same for the runs of node-scoped kinds on
a node (capacity, version, counters). One not judged yet shows when the monitor first saw it, so
one that is never judged goes stale like one that stopped being judged.
``kvcanary_path_judge_interval_seconds{target}`` and ``kvcanary_node_judge_interval_seconds{target}``
are how often each is due (the shortest interval of the kinds run there): ``KVCanaryPathNotJudged``
compares the path figures. Series exist only for the nodes and paths the target has now (at most
``MAX_PATHS`` paths each, and the nodes they are made of). ``kvcanary_paths_unprobed{target,reason}``
counts the pairs of a target's nodes that have no path series because no run goes down them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: (prefill node, decode node)
PathNames = tuple[str, str]


class LastJudged(Collector):
    """The parts of each target (``labels`` name a part), when each was last judged, and how often
    each is due."""

    def __init__(self, subject: str, labels: Sequence[str], what: str) -> None:
        self._subject, self._labels, self._what = subject, list(labels), what
        self._judged: dict[str, dict[Hashable, float]] = {}
        self._interval: dict[str, float] = {}

    def declare(self, target: str, parts: Iterable[Hashable], interval: float, now: float) -> None:
        """Export the target's parts from now on (a new one as first seen ``now``) and no others."""
        known = self._judged.get(target, {})
        current = {part: known.get(part, now) for part in parts}
        if not current:
            self.forget(target)
            return
        self._judged[target] = current
        self._interval[target] = interval

    def judged(self, target: str, part: Hashable, when: float) -> None:
        """Note a verdict on ``part``; a part the target no longer has is not brought back."""
        parts = self._judged.get(target)
        if parts is not None and part in parts:
            parts[part] = max(parts[part], when)

    def forget(self, target: str) -> None:
        self._judged.pop(target, None)
        self._interval.pop(target, None)

    def collect(self) -> Iterator[Metric]:
        last = GaugeMetricFamily(
            f"kvcanary_{self._subject}_last_judged_timestamp",
            f"Unix time a probe {self._what} last got a verdict other than error "
            f"(before its first, when the monitor first saw the {self._subject}).",
            labels=["target", *self._labels],
        )
        for target, parts in self._judged.items():
            for part, when in parts.items():
                names = list(part) if isinstance(part, tuple) else [str(part)]
                last.add_metric([target, *names], when)
        yield last
        interval = GaugeMetricFamily(
            f"kvcanary_{self._subject}_judge_interval_seconds",
            f"Seconds between the runs that judge each {self._subject} of the target.",
            labels=["target"],
        )
        for target, seconds in self._interval.items():
            interval.add_metric([target], seconds)
        yield interval


def path_coverage() -> LastJudged:
    return LastJudged("path", ["prefill", "decode"], "down the prefill x decode path")


def node_coverage() -> LastJudged:
    return LastJudged("node", ["node"], "of a node-scoped kind on the node")


class UnprobedPaths(Collector):
    """The pairs of each target's nodes that no path run goes down, by reason
    (``TargetConfig.unprobed_paths``)."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[str, int]] = {}

    def declare(self, target: str, counts: Mapping[str, int]) -> dict[str, int]:
        """Export ``counts`` for the target from now on (none when empty); return those that changed."""
        before = self._counts.pop(target, {})
        if counts:
            self._counts[target] = dict(counts)
        return {reason: pairs for reason, pairs in counts.items() if before.get(reason) != pairs}

    def forget(self, target: str) -> None:
        self._counts.pop(target, None)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvcanary_paths_unprobed",
            "Prefill x decode pairs (rank pairs) of the target's nodes that kvcanary does not probe, "
            "by why: no_bootstrap_port (a prefill node's is unknown), over_max_paths (past 256), "
            "credential_out_of_scope (a node the gateway lists outside the credential scope refuses "
            "requests without a key).",
            labels=["target", "reason"],
        )
        for target, counts in self._counts.items():
            for reason, pairs in counts.items():
                family.add_metric([target, reason], pairs)
        yield family
