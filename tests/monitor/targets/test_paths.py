"""A path's requests as SGLang's gateway would send them down one prefill x decode pair, ranks included
(``monitor/targets/paths.py``); the paths a target's nodes make (``TargetConfig.paths``). The probes
sent down real paths are in ``tests/monitor/runs/test_gateway_paths.py`` and ``test_gateway_dp_ranks.py``."""

from __future__ import annotations

import pytest

from kvcanary.monitor.config.targets import NodeConfig, TargetConfig
from kvcanary.monitor.targets.capacity import _sglang_node
from kvcanary.monitor.targets.paths import bootstrap_fields, of_rank, rank_fields
from kvcanary.probes.target import Node, ServingPath

PREFILL = Node("p", "prefill", "http://10.0.0.7:30000", "http://10.0.0.7:30000/metrics", 8998, dp_size=4)
DECODE = Node("d", "decode", "http://10.0.0.8:30000", "http://10.0.0.8:30000/metrics", dp_size=2)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_ranks_room_is_one_its_server_maps_to_that_rank(rank: int) -> None:
    rooms = [bootstrap_fields(PREFILL, rank)["bootstrap_room"] for _ in range(50)]
    assert all(0 <= room < 2**63 and room % 4 == rank for room in rooms)
    assert len(set(rooms)) == 50  # still random: no two requests in flight share a room
    fields = bootstrap_fields(PREFILL, rank)
    assert (fields["bootstrap_host"], fields["bootstrap_port"]) == ("10.0.0.7", 8998)


def test_each_leg_is_told_its_own_rank_and_decode_where_its_kv_is() -> None:
    path = ServingPath(PREFILL, DECODE, "p.dp3--d.dp1", prefill_rank=3, decode_rank=1)
    assert rank_fields(path) == {
        "prefill": {"routed_dp_rank": 3},
        "decode": {"routed_dp_rank": 1, "disagg_prefill_dp_rank": 3},
    }
    assert (path.prefill_name, path.decode_name) == ("p.dp3", "d.dp1")
    plain = ServingPath(PREFILL, DECODE, "p--d")
    assert rank_fields(plain) == {"prefill": {}, "decode": {}}
    assert (plain.prefill_name, plain.decode_name) == ("p", "d")


def test_a_nodes_smallest_rank_is_its_pool_and_each_rank_path_has_its_own() -> None:
    info = {
        "max_total_num_tokens": 16384,  # rank 0's, as SGLang's top level
        "context_length": 8192,
        "internal_states": [
            {"dp_rank": 0, "max_total_num_tokens": 16384},
            {"dp_rank": 1, "max_total_num_tokens": 1024},
        ],
    }
    node = _sglang_node(info, "server_info")
    assert node.kv_pool_tokens == 1024 and node.rank_pools == {0: 16384, 1: 1024}
    assert of_rank(node, 0).kv_pool_tokens == 16384 and of_rank(node, 1).kv_pool_tokens == 1024
    assert of_rank(node, None) is node


def test_a_target_has_a_path_per_rank_pair() -> None:
    target = TargetConfig.model_validate(
        {
            "name": "glm",
            "base_url": "http://10.0.0.1:30000",
            "tenants": [{"name": "a", "api_key_env": "KEY_A"}],
            "probes": ["canary"],
            "nodes": [
                {
                    "name": "p",
                    "role": "prefill",
                    "info_url": "http://10.0.0.7:30000",
                    "bootstrap_port": 8998,
                    "dp_size": 2,
                },
                {"name": "q", "role": "prefill", "info_url": "http://10.0.0.9:30000", "bootstrap_port": 8998},
                {"name": "d", "role": "decode", "info_url": "http://10.0.0.8:30000", "dp_size": 2},
            ],
        }
    )
    names = [path.name for path in target.paths()]
    assert names == ["p.dp0--d.dp0", "p.dp0--d.dp1", "p.dp1--d.dp0", "p.dp1--d.dp1", "q--d.dp0", "q--d.dp1"]


def test_pairs_of_a_node_outside_the_scope_that_refuses_without_a_key_are_counted_not_probed() -> None:
    """Two prefill and two decode nodes the gateway lists: one of each on an allowed host, one of
    each elsewhere. Those elsewhere are sent no key: the decode one that refused without a key
    takes its pairs out; the prefill one that answers without a key is probed without one."""

    def found(name: str, role: str, host: str, refuses: bool, **more: int) -> NodeConfig:
        # As discovery makes them: the marks are the monitor's, which a file may not state.
        node = NodeConfig.model_validate(
            {"name": name, "role": role, "info_url": f"http://{host}:30000", **more}
        )
        return node.model_copy(update={"discovered": True, "refuses_without_key": refuses})

    target = TargetConfig.model_validate(
        {
            "name": "glm",
            "base_url": "http://10.0.0.1:30000",
            "sglang_router": "http://10.0.0.1:30000",
            "tenants": [{"name": "a", "api_key_env": "KEY_A"}],
            "probes": ["canary"],
            "credential_hosts": ["10.0.0.0/24"],
        }
    )
    nodes = [
        found("p-in", "prefill", "10.0.0.7", True, bootstrap_port=8998),  # refuses, but gets a key
        found("p-out", "prefill", "192.0.2.7", False, bootstrap_port=8998, dp_size=2),
        found("d-in", "decode", "10.0.0.8", True),
        found("d-out", "decode", "192.0.2.8", True),
    ]
    target = target.model_copy(update={"nodes": nodes})
    assert target.shut_out() == {"d-out"}
    assert [path.name for path in target.paths()] == ["p-in--d-in", "p-out.dp0--d-in", "p-out.dp1--d-in"]
    assert target.unprobed_paths() == {
        "no_bootstrap_port": 0,
        "over_max_paths": 0,
        "credential_out_of_scope": 3,
    }
    opened = target.model_copy(update={"credential_hosts": ["10.0.0.0/24", "192.0.2.8"]})
    assert opened.shut_out() == set() and len(opened.paths()) == 6
    assert opened.unprobed_paths()["credential_out_of_scope"] == 0
