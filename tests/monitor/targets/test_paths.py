"""A path's requests as SGLang's gateway would send them down one prefill x decode pair, ranks included
(``monitor/targets/paths.py``); the paths a target's nodes make (``TargetConfig.paths``). The probes
sent down real paths are in ``tests/monitor/runs/test_gateway_paths.py`` and ``test_gateway_dp_ranks.py``."""

from __future__ import annotations

import pytest

from kvcanary.monitor.config.targets import TargetConfig
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
