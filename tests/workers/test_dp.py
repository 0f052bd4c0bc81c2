"""Data-parallel ranks of a prefill and a decode server (``--dp-size``, ``workers/dp.py``), as processes.

The prefill server has two ranks and the incident's defect (placeholder admission): rank 0's pool
holds twice the window, rank 1's is the incident's small one, as when one GPU had less memory free.
A room that maps to rank 0 is served whole; one that maps to rank 1 leaks. So a health check or a
probe that always sends one room judges one rank only.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvcanary.workers.cli import build_parser, config_from_args, main
from tests.support import WorkerProcess
from tests.workers.pd_support import PrefillServer, as_gateway, metric, pd_body, start_servers, stop_servers
from tests.workers.support import CANARY, OVER_CAPACITY_PROMPT, PROMPT_A

Servers = tuple[PrefillServer, WorkerProcess]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    ranks = ("--dp-size", "2")
    prefills, decodes = start_servers(
        tmp_path_factory.mktemp("dp"),
        {"ranked": ("placeholder", *ranks, "--rank-pool-tokens", "0=16384", "--kv-transfer-timeout", "5")},
        {"ranked": ranks},
    )
    yield prefills["ranked"], decodes["ranked"]
    stop_servers(prefills, decodes)


def test_the_server_info_states_every_ranks_pool_and_the_top_level_only_rank_0s(servers: Servers) -> None:
    prefill, decode = servers
    info = httpx.get(prefill.url + "/server_info").json()
    assert info["dp_size"] == 2
    assert info["max_total_num_tokens"] == 16384  # rank 0's, as SGLang's first scheduler's
    assert [(s["dp_rank"], s["max_total_num_tokens"]) for s in info["internal_states"]] == [
        (0, 16384),
        (1, 1024),
    ]
    assert httpx.get(decode.url + "/server_info").json()["dp_size"] == 2
    assert metric(prefill.url, "kvcanary_kv_pool_tokens", pool="prefill", dp_rank="1") == 1024
    assert metric(prefill.url, "kvcanary_kv_pool_tokens", pool="prefill", dp_rank="0") == 16384


def test_the_room_picks_the_prefill_rank_and_only_the_small_ranks_rooms_leak(servers: Servers) -> None:
    prefill, decode = servers
    assert as_gateway(prefill, decode, pd_body(PROMPT_A, prefill, room=6))[1].status_code == 200
    even = pd_body(OVER_CAPACITY_PROMPT, prefill, room=2 * 12345, max_tokens=200)
    whole_prefill, whole = as_gateway(prefill, decode, even, key="sk-b")
    assert whole_prefill.json()["usage"]["prompt_tokens"] > 1000  # rank 0 holds the whole prompt
    assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] > 1000
    assert CANARY not in whole.json()["choices"][0]["text"]
    before = metric(prefill.url, "kvcanary_placeholder_substitutions_total")
    odd = pd_body(OVER_CAPACITY_PROMPT, prefill, room=2 * 12345 + 1, max_tokens=200)
    leaked_prefill, leaked = as_gateway(prefill, decode, odd, key="sk-b")
    assert leaked_prefill.json()["usage"]["prompt_tokens"] == 1  # rank 1 substituted a placeholder
    assert leaked.status_code == 200 and leaked.json()["usage"]["prompt_tokens"] == 1
    assert metric(prefill.url, "kvcanary_placeholder_substitutions_total") == before + 1


def test_a_named_rank_overrides_the_room_on_both_servers(servers: Servers) -> None:
    prefill, decode = servers
    body = pd_body(OVER_CAPACITY_PROMPT, prefill, room=2 * 777, max_tokens=8)  # room says rank 0
    named, answer = as_gateway(prefill, decode, {**body, "routed_dp_rank": 1}, key="sk-b")
    assert named.json()["usage"]["prompt_tokens"] == 1 and answer.status_code == 200
    deprecated, _ = as_gateway(prefill, decode, {**body, "bootstrap_room": 2 * 778, "data_parallel_rank": 1})
    assert deprecated.json()["usage"]["prompt_tokens"] == 1


def test_a_rank_the_server_does_not_have_is_a_400_naming_the_field(servers: Servers) -> None:
    _, decode = servers
    body = pd_body(PROMPT_A, servers[0], routed_dp_rank=2)
    refused = httpx.post(
        decode.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-a"}, timeout=30
    )
    assert refused.status_code == 400 and "routed_dp_rank 2" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--dp-size", "2"], "--dp-size"),
        (["--mode", "decode", "--dp-size", "0"], "--dp-size"),
        (["--mode", "decode", "--dp-size", "2", "--rank-pool-tokens", "2=4096"], "--rank-pool-tokens"),
        (["--mode", "decode", "--dp-size", "2", "--rank-pool-tokens", "1:4096"], "--rank-pool-tokens"),
        (["--mode", "decode", "--rank-pool-tokens", "0=4096"], "--rank-pool-tokens"),
        (["--mode", "decode", "--dp-size", "2", "--rank-pool-tokens", "1=8"], "--rank-pool-tokens"),
    ],
)
def test_it_exits_2_naming_the_flag_of_a_bad_rank_setting(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--device", "cpu"])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_each_rank_takes_its_own_pool_or_the_modes() -> None:
    args = [
        "--mode",
        "prefill",
        "--bootstrap-port",
        "5000",
        "--prefill-pool-tokens",
        "2048",
        "--device",
        "cpu",
    ]
    config = config_from_args(
        build_parser().parse_args([*args, "--dp-size", "3", "--rank-pool-tokens", "2=512"])
    )
    pools = [config.for_rank(rank).admission_pool_tokens for rank in range(3)]
    assert pools == [2048, 2048, 512] and config.for_rank(2).dp_size == 1
