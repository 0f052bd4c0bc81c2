"""How recently each prefill x decode path of a disaggregated target was judged: the coverage of
the paths a gateway's policy may never pick for a probe (``monitor/targets/paths.py``).

``kvcanary_path_last_judged_timestamp{target,prefill,decode}`` is when a run down the path last
ended in a verdict other than ``error`` (a pass, a leak, a mismatch: the output was judged). A
path not judged yet shows when the monitor first saw it, so a path that is never judged goes stale
like one that stopped being judged. ``kvcanary_path_judge_interval_seconds{target}`` is how often
each path is due (the shortest interval of the target's path kinds): ``KVCanaryPathNotJudged``
compares the two. Series exist only for the paths the target has now (at most ``MAX_PATHS`` each).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: (prefill node, decode node)
PathNames = tuple[str, str]


class PathCoverage(Collector):
    """The paths of each target, when each was last judged, and how often each is due."""

    def __init__(self) -> None:
        self._judged: dict[str, dict[PathNames, float]] = {}
        self._interval: dict[str, float] = {}

    def declare(self, target: str, paths: Iterable[PathNames], interval: float, now: float) -> None:
        """Export the target's paths from now on (a new one as first seen ``now``) and no others."""
        known = self._judged.get(target, {})
        current = {path: known.get(path, now) for path in paths}
        if not current:
            self.forget(target)
            return
        self._judged[target] = current
        self._interval[target] = interval

    def judged(self, target: str, path: PathNames, when: float) -> None:
        """Note a verdict on ``path``; a path the target no longer has is not brought back."""
        paths = self._judged.get(target)
        if paths is not None and path in paths:
            paths[path] = max(paths[path], when)

    def forget(self, target: str) -> None:
        self._judged.pop(target, None)
        self._interval.pop(target, None)

    def collect(self) -> Iterator[Metric]:
        last = GaugeMetricFamily(
            "kvcanary_path_last_judged_timestamp",
            "Unix time a probe down the prefill x decode path last got a verdict other than error "
            "(before its first, when the monitor first saw the path).",
            labels=["target", "prefill", "decode"],
        )
        for target, paths in self._judged.items():
            for (prefill, decode), when in paths.items():
                last.add_metric([target, prefill, decode], when)
        yield last
        interval = GaugeMetricFamily(
            "kvcanary_path_judge_interval_seconds",
            "Seconds between the runs that judge each prefill x decode path of the target.",
            labels=["target"],
        )
        for target, seconds in self._interval.items():
            interval.add_metric([target], seconds)
        yield interval
