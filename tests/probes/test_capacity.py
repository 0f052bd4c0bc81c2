"""The capacity probe: each node's KV pools against its context window, without one completion.

Reference workers as real processes for pools above, equal to and below the window; the engines
nobody here wrote through the response shapes their sources produce (tests/fixtures/engines), served
at the network seam.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import Node
from tests.probes.probe_harness import KEYS, MODEL, Reference, loopback_target
from tests.support import free_port
from tests.support.loopback import Handler

ENGINES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


def config(
    url: str, engine: str = "reference", nodes: list[dict[str, str]] | None = None, **options: Any
) -> TargetConfig:
    return TargetConfig(
        name="t",
        base_url=url,
        engine=engine,
        model=MODEL,
        tenants=[{"name": "alice"}],
        probes=["capacity"],
        options={"capacity": options} if options else {},
        nodes=nodes or [],
    )


def audit(
    cfg: TargetConfig, node: Node | None = None, transport: Handler | None = None
) -> tuple[ProbeResult, int]:
    """Run the capacity probe on ``node`` (default: the target's first); return it and completions sent."""
    sent = 0

    async def go() -> ProbeResult:
        nonlocal sent
        keys: dict[str, str | None] = {"alice": KEYS["alice"]}
        made = OpenAIHttpTarget(cfg, keys) if transport is None else loopback_target(cfg, keys, transport)
        async with made as target:
            result, _ = await execute_probe(
                "capacity", target, MarkerBook(), cfg, node=node or target.nodes[0]
            )
            sent = int(result.measurements.get("prompt_tokens_spent", 0))
            return result

    return asyncio.run(go()), sent


@pytest.mark.parametrize(
    ("flags", "verdict", "reason"),
    [
        (("--kv-pool-tokens", "16384", "--context-window", "8192"), Verdict.PASS, "headroom_ok"),
        (("--kv-pool-tokens", "8192", "--context-window", "8192"), Verdict.PASS, "headroom_below_target"),
        (
            ("--kv-pool-tokens", "4096", "--context-window", "8192"),
            Verdict.MISMATCH,
            "pool_below_context_window",
        ),
    ],
    ids=["above", "equal", "below"],
)
def test_a_single_pool_above_equal_to_and_below_its_window(
    reference: Callable[..., Reference], flags: tuple[str, ...], verdict: Verdict, reason: str
) -> None:
    worker = reference("--mode", "aggregated", *flags)
    result, sent = audit(config(worker.url))
    assert (result.verdict, result.reason) == (verdict, reason)
    assert result.measurements["context_window_tokens"] == 8192
    assert sent == 0  # an audit sends no completion


def test_a_disaggregated_node_is_judged_by_its_tightest_pool(reference: Callable[..., Reference]) -> None:
    worker = reference(
        "--mode", "disaggregated", "--prefill-pool-tokens", "2048", "--decode-pool-tokens", "16384",
        "--context-window", "8192",
    )  # fmt: skip
    result, _ = audit(config(worker.url))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "pool_below_context_window")
    assert "prefill pool 2,048 tokens against a context window of 8,192 (0.25x)" in result.detail
    assert result.evidence["pools"] == {"prefill": 2048, "decode": 16384}
    assert result.measurements["pool_tokens.decode"] == 16384


def test_each_listed_node_is_audited_at_its_own_address(reference: Callable[..., Reference]) -> None:
    prefill = reference("--mode", "aggregated", "--kv-pool-tokens", "4096", "--context-window", "8192")
    decode = reference("--mode", "aggregated", "--kv-pool-tokens", "32768", "--context-window", "8192")
    cfg = config(
        prefill.url,
        nodes=[
            {"name": "prefill-0", "role": "prefill", "info_url": prefill.url},
            {"name": "decode-0", "role": "decode", "info_url": decode.url},
        ],
    )
    first, second = cfg.node_list()
    assert audit(cfg, first)[0].verdict is Verdict.MISMATCH
    assert audit(cfg, second)[0].reason == "headroom_ok"


# --- engines nobody here wrote, in the shapes their sources produce --------------------------------


def serve_fixture(files: dict[str, str]) -> Handler:
    """Serve ``{path: fixture file}``; anything else is a 404 in SGLang's error shape."""

    def answer(request: httpx.Request) -> httpx.Response:
        name = files.get(request.url.path)
        if name is None:
            return httpx.Response(404, json={"object": "error", "message": "Not Found", "code": 404})
        return httpx.Response(200, text=(ENGINES / name).read_text())

    return answer


def test_the_incidents_prefill_node_is_a_mismatch_with_its_figures() -> None:
    transport = serve_fixture({"/server_info": "sglang-0.5.11-prefill-incident.json"})
    result, _ = audit(config("http://sglang.test", "sglang"), transport=transport)
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "pool_below_context_window")
    assert "681,280 tokens against a context window of 1,048,576 (0.65x)" in result.detail
    assert result.evidence["version"] == "0.5.11" and result.evidence["disaggregation_mode"] == "prefill"


def test_the_fixed_prefill_node_passes_with_twice_the_window() -> None:
    transport = serve_fixture({"/server_info": "sglang-0.5.22-prefill-fixed.json"})
    result, _ = audit(config("http://sglang.test", "sglang"), transport=transport)
    assert (result.verdict, result.reason) == (Verdict.PASS, "headroom_ok")


def test_an_older_sglang_is_read_at_get_server_info() -> None:
    alone = serve_fixture({"/get_server_info": "sglang-0.5.9-prefill-recorded.json"})
    result, _ = audit(config("http://sglang.test", "sglang"), transport=alone)
    # This recorded node states no context_length and nothing serves /v1/models: unknown, not a pass.
    assert (result.verdict, result.reason) == (Verdict.ERROR, "capacity_unknown")
    assert result.detail.startswith("context window not published")
    recorded, models = "sglang-0.5.9-prefill-recorded.json", "sglang-0.5.11-v1-models.json"
    both = serve_fixture({"/get_server_info": recorded, "/v1/models": models})
    result, _ = audit(config("http://sglang.test", "sglang"), transport=both)
    assert result.verdict is not Verdict.ERROR, result.detail
    assert result.evidence["source"] == "/get_server_info,/v1/models"


def test_a_null_context_length_falls_back_to_v1_models() -> None:
    transport = serve_fixture(
        {
            "/server_info": "sglang-0.5.11-single-context-null.json",
            "/v1/models": "sglang-0.5.11-v1-models.json",
        }
    )
    result, _ = audit(config("http://sglang.test", "sglang"), transport=transport)
    models = json.loads((ENGINES / "sglang-0.5.11-v1-models.json").read_text())
    assert result.evidence["context_window"] == models["data"][0]["max_model_len"]


@pytest.mark.parametrize("broken", ["sglang-broken-missing-fields.json", "sglang-broken-nulls.json"])
def test_what_a_node_does_not_publish_is_an_error_naming_it(broken: str) -> None:
    result, _ = audit(
        config("http://sglang.test", "sglang"), transport=serve_fixture({"/server_info": broken})
    )
    assert (result.verdict, result.reason) == (Verdict.ERROR, "capacity_unknown")
    assert "KV pool" in result.detail and "/server_info" in result.detail


def test_an_unreachable_info_url_is_an_error_that_says_where_it_looked(unreachable: Reference) -> None:
    result, _ = audit(config(unreachable.url))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "capacity_unknown")
    assert "cannot read" in result.detail and unreachable.url in result.detail


def test_an_operator_can_state_what_the_engine_does_not() -> None:
    transport = serve_fixture({"/server_info": "sglang-broken-nulls.json"})
    cfg = config("http://sglang.test", "sglang", context_window=1048576, kv_pool_tokens=681280)
    result, _ = audit(cfg, transport=transport)
    assert (result.verdict, result.evidence["pools"]) == (Verdict.MISMATCH, {"stated": 681280})


def test_vllm_capacity_comes_from_cache_config_info_and_v1_models() -> None:
    transport = serve_fixture(
        {
            "/metrics": "../metrics/vllm.txt",
            "/v1/models": "../vllm/models.json",
            "/version": "vllm-0.32.0-version.json",
        }
    )
    result, _ = audit(config("http://vllm.test", "vllm"), transport=transport)
    assert result.evidence["pools"] == {"gpu": 1048576} and result.evidence["context_window"] == 1024
    assert (result.verdict, result.reason, result.evidence["version"]) == (
        Verdict.PASS,
        "headroom_ok",
        "0.32.0",
    )


# --- decode nodes: their pool is reported, not judged against the window -------------------------


def test_a_decode_server_below_the_window_is_reported_not_judged(reference: Callable[..., Reference]) -> None:
    # The same pool on a prefill server is the incident's mismatch; on a decode server it holds
    # running sequences, each admitted by a prefill node, so it is not held against the window.
    decode = reference("--mode", "decode", "--decode-pool-tokens", "4096", "--context-window", "8192")
    result, sent = audit(config(decode.url))
    assert (result.verdict, result.reason) == (Verdict.PASS, "decode_pool_not_judged")
    assert result.evidence["role"] == "decode" and result.evidence["pools"] == {"decode": 4096}
    assert result.measurements["pool_tokens.decode"] == 4096
    assert result.measurements["context_window_tokens"] == 8192
    assert "headroom_ratio" not in result.measurements and sent == 0
    prefill = reference("--mode", "prefill", "--bootstrap-port", str(free_port()), "--prefill-pool-tokens",
                        "4096", "--context-window", "8192")  # fmt: skip
    assert audit(config(prefill.url))[0].reason == "pool_below_context_window"


# --- PD nodes: whether their KV hand-offs are checksummed ----------------------------------------


def test_a_pd_node_without_the_checksum_is_said_beside_its_pools_and_exported_as_0(
    reference: Callable[..., Reference],
) -> None:
    plain = reference("--mode", "decode", "--decode-pool-tokens", "4096", "--context-window", "8192")
    checked = reference("--mode", "decode", "--decode-pool-tokens", "4096", "--kv-checksum")
    result, _ = audit(config(plain.url))
    # A hardening gap, not a leak seen: the verdict stays the pool's, the gap is beside it.
    assert (result.verdict, result.reason) == (Verdict.PASS, "decode_pool_not_judged")
    assert result.evidence["kv_transfer_checksum"]["state"] == "off"
    assert result.measurements["kv_transfer_checksum_enabled"] == 0
    assert "KV hand-offs are not checksummed (disaggregation_enable_kv_checksum false)" in result.detail
    on, _ = audit(config(checked.url))
    assert (on.verdict, on.reason) == (Verdict.PASS, "decode_pool_not_judged")
    assert on.evidence["kv_transfer_checksum"]["state"] == "on" and "checksummed" not in on.detail
    assert on.measurements["kv_transfer_checksum_enabled"] == 1

    required, _ = audit(config(plain.url, require_kv_checksum=True))
    assert (required.verdict, required.reason) == (Verdict.MISMATCH, "kv_transfer_unverified")
    assert required.evidence["capacity_reason"] == "decode_pool_not_judged"
    assert audit(config(checked.url, require_kv_checksum=True))[0].verdict is Verdict.PASS

    metrics = MonitorMetrics()
    metrics.observe("t", "capacity", result, 0.1, 0.0, node="d0")
    metrics.observe("t", "capacity", on, 0.1, 0.0, node="d1")
    page = metrics.exposition().decode()
    assert 'kvcanary_node_kv_transfer_checksum_enabled{node="d0",target="t"} 0.0' in page
    assert 'kvcanary_node_kv_transfer_checksum_enabled{node="d1",target="t"} 1.0' in page


def test_a_node_that_hands_nothing_over_a_wire_is_not_asked(reference: Callable[..., Reference]) -> None:
    # Aggregated, and the in-process disaggregated mode whose one process holds both pools.
    for flags in (
        ("--kv-pool-tokens", "16384"),
        ("--mode", "disaggregated", "--prefill-pool-tokens", "16384"),
    ):
        result, _ = audit(config(reference(*flags).url, require_kv_checksum=True))
        assert result.verdict is Verdict.PASS and "kv_transfer_checksum" not in result.evidence
        assert "kv_transfer_checksum_enabled" not in result.measurements


def test_sglang_states_its_checksum_and_a_release_that_does_not_is_unknown() -> None:
    info = json.loads((ENGINES / "sglang-0.5.11-decode-incident.json").read_text())
    for stated, state in ((False, "off"), (True, "on")):
        answer = serve_json({**info, "disaggregation_enable_kv_checksum": stated})
        result, _ = audit(config("http://sglang.test", "sglang"), transport=answer)
        assert result.evidence["kv_transfer_checksum"]["state"] == state, result.evidence
    old = serve_fixture({"/server_info": "sglang-0.5.11-decode-incident.json"})
    result, _ = audit(config("http://sglang.test", "sglang"), transport=old)
    assert (
        result.reason == "decode_pool_not_judged"
        and result.evidence["kv_transfer_checksum"]["state"] == "unknown"
    )
    assert "kv_transfer_checksum_enabled" not in result.measurements
    required, _ = audit(config("http://sglang.test", "sglang", require_kv_checksum=True), transport=old)
    assert (required.verdict, required.reason) == (Verdict.ERROR, "kv_transfer_checksum_unknown")


def test_sglangs_decode_node_states_its_pool_without_a_name() -> None:
    transport = serve_fixture({"/server_info": "sglang-0.5.11-decode-incident.json"})
    result, _ = audit(config("http://sglang.test", "sglang"), transport=transport)
    assert (result.verdict, result.reason) == (Verdict.PASS, "decode_pool_not_judged")
    assert result.evidence["pools"] == {"decode": 1310720}
    assert "decode pool 1,310,720 tokens (context window 1,048,576)" in result.detail


def serve_json(body: dict[str, Any]) -> Handler:
    """Serve ``body`` at /server_info; anything else is a 404 in SGLang's error shape."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json=body)
        return httpx.Response(404, json={"object": "error", "message": "Not Found", "code": 404})

    return answer


@pytest.mark.parametrize(("role", "reason"), [("decode", "decode_pool_not_judged"),
                                              ("prefill", "pool_below_context_window")])  # fmt: skip
def test_a_node_whose_engine_states_no_mode_is_judged_by_its_listed_role(role: str, reason: str) -> None:
    modeless = serve_json({"context_length": 8192, "max_total_num_tokens": 4096, "version": "0.5.11"})
    cfg = config("http://sglang.test", "sglang", nodes=[{"name": "n0", "role": role}])
    result, _ = audit(cfg, transport=modeless)
    assert result.reason == reason and result.evidence["pools"] == {role: 4096}


def test_the_engines_own_mode_outranks_the_listed_role() -> None:
    # Listed as decode, but the node says it is a prefill server: admission runs by what it is.
    stated = serve_json(
        {"context_length": 8192, "max_total_num_tokens": 4096, "disaggregation_mode": "prefill"}
    )
    cfg = config("http://sglang.test", "sglang", nodes=[{"name": "n0", "role": "decode"}])
    result, _ = audit(cfg, transport=stated)
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "pool_below_context_window")
    assert result.evidence["role"] == "prefill" and result.evidence["configured_role"] == "decode"
