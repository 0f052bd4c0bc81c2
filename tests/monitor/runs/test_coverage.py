"""``monitor/runs/coverage.py``: what a run of each kind covers, and the coverage series declared for
a target: its paths (at most ``MAX_PATHS``) and the pairs no run goes down, counted and logged."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcanary.monitor.config.targets import MAX_PATHS, TargetConfig
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.coverage import declare_coverage, nodes_of_run
from kvcanary.monitor.targets.scrape import parse_samples


def fleet(prefills: int, decodes: int, *, blind: int = 0, **target: Any) -> TargetConfig:
    """A target of ``prefills`` prefill nodes with bootstrap ports, ``blind`` without, and ``decodes``
    decode nodes."""

    def node(name: str, role: str, host: str, **more: Any) -> dict[str, Any]:
        return {"name": name, "role": role, "info_url": f"http://{host}:30000", **more}

    nodes = [node(f"p{i}", "prefill", f"10.0.1.{i}", bootstrap_port=8998) for i in range(prefills)]
    nodes += [node(f"b{i}", "prefill", f"10.0.2.{i}") for i in range(blind)]
    nodes += [node(f"d{i}", "decode", f"10.0.3.{i}") for i in range(decodes)]
    return TargetConfig.model_validate(
        {
            "name": "glm",
            "base_url": "http://10.0.0.1:30000",
            "tenants": [{"name": "a", "api_key_env": "KEY_A"}],
            "probes": ["canary", "capacity"],
            "nodes": nodes,
            **target,
        }
    )


def series(metrics: MonitorMetrics, name: str) -> dict[str, float]:
    samples = parse_samples(generate_latest(metrics.registry).decode())
    return {k: v for k, v in samples.items() if k.startswith(name + "{")}


def test_the_pairs_past_the_cap_or_without_a_bootstrap_port_are_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 17 x 16 pairs that can be probed, 16 past the cap; a prefill node with 2 ranks and no known
    # bootstrap port makes 2 x 16 pairs no run can go down the gateway's way.
    target = fleet(17, 16, blind=1)
    target = target.model_copy(
        update={"nodes": [n.model_copy(update={"dp_size": 2}) if n.name == "b0" else n for n in target.nodes]}
    )
    metrics = MonitorMetrics(CollectorRegistry())
    with caplog.at_level(logging.WARNING, "kvcanary.runner"):
        declare_coverage(metrics, target)

    assert len(target.paths()) == MAX_PATHS == len(nodes_of_run(target, "canary")) - 1
    assert len(series(metrics, "kvcanary_path_last_judged_timestamp")) == MAX_PATHS
    assert series(metrics, "kvcanary_paths_unprobed") == {
        'kvcanary_paths_unprobed{reason="no_bootstrap_port",target="glm"}': 32.0,
        'kvcanary_paths_unprobed{reason="over_max_paths",target="glm"}': 16.0,
    }
    said = [r.getMessage() for r in caplog.records]
    assert any("32 prefill x decode pair(s) not probed (no_bootstrap_port)" in m for m in said), said
    assert any("16 prefill x decode pair(s) not probed (over_max_paths)" in m for m in said), said
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvcanary.runner"):
        declare_coverage(metrics, target)  # a reload, or another target's nodes changing: said once
    assert not caplog.records


def test_a_target_whose_pairs_are_all_probed_says_0_and_one_without_path_kinds_says_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = MonitorMetrics(CollectorRegistry())
    with caplog.at_level(logging.WARNING, "kvcanary.runner"):
        declare_coverage(metrics, fleet(2, 2))
    assert set(series(metrics, "kvcanary_paths_unprobed").values()) == {0.0}
    assert not caplog.records

    declare_coverage(metrics, fleet(2, 2, path_probes=[]))  # a reload: the target probes no path
    assert series(metrics, "kvcanary_paths_unprobed") == {}
    declare_coverage(metrics, fleet(20, 20))
    metrics.forget("glm")  # a reload removed the target
    assert series(metrics, "kvcanary_paths_unprobed") == {}


def test_a_target_that_leaves_its_pairs_to_the_gateway_has_no_unprobed_series(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No gateway named and no prefill node's bootstrap port stated: the file's way to probe only
    through the gateway (kvcanary.example.yml), not a blind spot to page for."""
    metrics = MonitorMetrics(CollectorRegistry())
    with caplog.at_level(logging.WARNING, "kvcanary.runner"):
        declare_coverage(metrics, fleet(0, 2, blind=2))
    assert series(metrics, "kvcanary_paths_unprobed") == {} and not caplog.records
    # Named behind a gateway, the same nodes are pairs it routes to and nobody probes.
    declare_coverage(metrics, fleet(0, 2, blind=2, sglang_router="http://10.0.0.1:30000"))
    assert series(metrics, "kvcanary_paths_unprobed") == {
        'kvcanary_paths_unprobed{reason="no_bootstrap_port",target="glm"}': 4.0,
        'kvcanary_paths_unprobed{reason="over_max_paths",target="glm"}': 0.0,
        'kvcanary_paths_unprobed{reason="credential_out_of_scope",target="glm"}': 0.0,
    }
