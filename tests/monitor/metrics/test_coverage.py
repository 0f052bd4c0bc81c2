"""``monitor/metrics/coverage.py``: when each node and each prefill x decode path was last judged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvcanary.monitor.metrics.coverage import node_coverage, path_coverage
from kvcanary.monitor.targets.scrape import parse_samples


def exposed(*collectors: object) -> dict[str, float]:
    """Each labelled series the collectors export (the parser also keeps a total by name: left out)."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)  # type: ignore[arg-type]
    return {k: v for k, v in parse_samples(generate_latest(registry).decode()).items() if "{" in k}


def test_a_part_shows_when_first_seen_until_judged_then_its_latest_verdict_time() -> None:
    nodes, paths = node_coverage(), path_coverage()
    nodes.declare("glm", ["p0", "d0"], 30.0, now=100.0)
    paths.declare("glm", [("p0", "d0")], 10.0, now=100.0)
    nodes.judged("glm", "p0", 130.0)
    nodes.judged("glm", "p0", 120.0)  # a late recording never moves it back
    paths.judged("glm", ("p0", "d0"), 115.0)

    samples = exposed(nodes, paths)
    assert samples['kvcanary_node_last_judged_timestamp{node="p0",target="glm"}'] == 130.0
    assert samples['kvcanary_node_last_judged_timestamp{node="d0",target="glm"}'] == 100.0
    assert samples['kvcanary_node_judge_interval_seconds{target="glm"}'] == 30.0
    assert samples['kvcanary_path_last_judged_timestamp{decode="d0",prefill="p0",target="glm"}'] == 115.0
    assert samples['kvcanary_path_judge_interval_seconds{target="glm"}'] == 10.0


def test_a_part_that_left_is_dropped_and_not_brought_back_by_a_late_verdict() -> None:
    nodes = node_coverage()
    nodes.declare("glm", ["p0", "p1"], 30.0, now=100.0)
    nodes.judged("glm", "p1", 110.0)
    nodes.declare("glm", ["p0"], 30.0, now=200.0)  # p1 left the gateway; p0 keeps its first-seen time
    nodes.judged("glm", "p1", 210.0)

    samples = exposed(nodes)
    assert [k for k in samples if k.startswith("kvcanary_node_last_judged")] == [
        'kvcanary_node_last_judged_timestamp{node="p0",target="glm"}'
    ]
    assert samples['kvcanary_node_last_judged_timestamp{node="p0",target="glm"}'] == 100.0
    nodes.declare("glm", [], 30.0, now=300.0)  # no node-scoped kind any more: no series at all
    assert exposed(nodes) == {}
