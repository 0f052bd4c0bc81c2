"""OpenAIHttpTarget's lookups: capacity by engine and token counting, faked at the network seam.

Shapes from ``docs/engines.md``: SGLang's ``/get_server_info`` (and ``/server_info``, and a PD
router's per-role answer), the reference worker's ``kv_pools``, vLLM's ``/v1/models`` and
``vllm:cache_config_info``, llama.cpp's ``/props``, and each engine's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.monitor.targets.test_targets import Handler, call, make_target

# --- capacity ---------------------------------------------------------------------------------------------


def routes(table: dict[str, Any]) -> Handler:
    """Answer GETs from ``table`` (dict → JSON, str → text); anything else is a 404."""

    def handler(request: httpx.Request) -> httpx.Response:
        value = table.get(request.url.path)
        if value is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if isinstance(value, str):
            return httpx.Response(200, text=value)
        return httpx.Response(200, json=value)

    return handler


def capacity(table: dict[str, Any], **kw: Any) -> Any:
    return asyncio.run(call(make_target(routes(table), **kw), lambda t: t.capacity()))


SGLANG_INFO = {
    "context_length": 1048576,
    "page_size": 64,
    "disaggregation_mode": "prefill",
    "max_total_num_tokens": 681280,
    "max_req_input_len": 681274,
    "version": "0.5.11",
}
VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2048"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_sglang_capacity_comes_from_get_server_info() -> None:
    cap = capacity({"/get_server_info": SGLANG_INFO}, engine="sglang")
    assert (cap.context_window, cap.kv_pool_tokens, cap.max_req_input_len) == (1048576, 681280, 681274)
    assert (cap.page_size, cap.disaggregation_mode, cap.version) == (64, "prefill", "0.5.11")
    assert cap.admission_limit == 681274


def test_newer_sglang_is_read_at_server_info_with_scheduler_fields_in_internal_states() -> None:
    info = {
        "context_length": None,
        "page_size": 1,
        "internal_states": [{"max_total_num_tokens": 5000, "max_req_input_len": 4994}],
    }
    cap = capacity(
        {"/server_info": info, "/v1/models": {"data": [{"id": "m", "max_model_len": 8192}]}}, engine="sglang"
    )
    assert (cap.context_window, cap.kv_pool_tokens, cap.max_req_input_len, cap.source) == (
        8192,
        5000,
        4994,
        "/server_info,/v1/models",
    )


def test_the_reference_workers_kv_pools_set_the_admission_pool_to_the_smallest() -> None:
    info = {**SGLANG_INFO, "max_total_num_tokens": 4096, "kv_pools": {"prefill": 1024, "decode": 4096}}
    cap = capacity({"/get_server_info": info}, engine="reference")
    assert cap.pools == {"prefill": 1024, "decode": 4096} and cap.kv_pool_tokens == 1024


def test_an_sglang_pd_router_reports_the_smallest_node_of_each_role() -> None:
    node = {**SGLANG_INFO}
    info = {
        "prefill": [node, {**node, "max_total_num_tokens": 600000}],
        "decode": [{**node, "max_total_num_tokens": 2000000, "disaggregation_mode": "decode"}],
    }
    cap = capacity({"/get_server_info": info}, engine="sglang")
    assert cap.pools == {"prefill": 600000, "decode": 2000000}
    assert (cap.kv_pool_tokens, cap.disaggregation_mode) == (600000, "router")


def test_vllm_capacity_multiplies_gpu_blocks_by_block_size_from_metrics() -> None:
    cap = capacity(
        {
            "/v1/models": {"data": [{"id": "m", "max_model_len": 32768}]},
            "/metrics": VLLM_METRICS,
            "/version": {"version": "0.11.0"},
        },
        engine="vllm",
    )
    assert (cap.context_window, cap.kv_pool_tokens, cap.page_size, cap.version) == (
        32768,
        32768,
        16,
        "0.11.0",
    )


def test_llamacpp_capacity_is_the_per_slot_context() -> None:
    props = {
        "default_generation_settings": {"n_ctx": 4096, "params": {}},
        "total_slots": 4,
        "build_info": "b6000",
    }
    cap = capacity({"/props": props}, engine="llamacpp")
    assert (cap.context_window, cap.kv_pool_tokens, cap.version) == (4096, 4096, "b6000")


def test_a_hosted_api_states_only_max_model_len_when_it_has_one() -> None:
    assert (
        capacity(
            {"/v1/models": {"data": [{"id": "m", "max_model_len": 131072}]}}, engine="openai"
        ).context_window
        == 131072
    )
    assert capacity({"/v1/models": {"data": [{"id": "m"}]}}, engine="openai").admission_limit is None


@pytest.mark.parametrize("engine", ["sglang", "reference", "vllm", "llamacpp", "openai"])
def test_failed_lookups_give_none_fields_never_an_exception(engine: str) -> None:
    cap = capacity({"/metrics": "garbage {{{", "/props": "not json"}, engine=engine)
    assert cap.admission_limit is None


def test_capacity_stated_in_the_boundary_options_overrides_the_engine() -> None:
    cap = capacity(
        {"/get_server_info": SGLANG_INFO},
        engine="sglang",
        options={"boundary": {"context_window": 2000, "kv_pool_tokens": 1500}},
    )
    assert (cap.context_window, cap.kv_pool_tokens, cap.admission_limit) == (2000, 1500, 1500)
    assert cap.source.endswith("+config")


# --- tokenizing ---------------------------------------------------------------------------------------


def tokenize_handler(seen: list[dict[str, Any]], answer: dict[str, Any], status: int = 200) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, **json.loads(request.content)})
        return httpx.Response(status, json=answer)

    return handler


@pytest.mark.parametrize(
    ("engine", "answer", "sent"),
    [
        ("vllm", {"count": 3, "max_model_len": 8192, "tokens": [1, 2, 3]}, {"prompt": "abc"}),
        ("reference", {"count": 3, "tokens": [97, 98, 99], "max_model_len": 8192}, {"prompt": "abc"}),
        ("sglang", {"tokens": [1, 2, 3], "count": 3}, {"prompt": "abc"}),
        ("llamacpp", {"tokens": [1, 2, 3]}, {"content": "abc"}),
    ],
)
def test_count_tokens_speaks_each_engines_tokenize_shape(
    engine: str, answer: dict[str, Any], sent: dict[str, Any]
) -> None:
    seen: list[dict[str, Any]] = []
    target = make_target(tokenize_handler(seen, answer), engine=engine)
    assert asyncio.run(call(target, lambda t: t.count_tokens("abc"))) == 3
    assert seen == [{"path": "/tokenize", **sent}]


def test_count_tokens_is_none_without_a_tokenizer() -> None:
    seen: list[dict[str, Any]] = []
    for engine in ("openai", "vllm"):
        target = make_target(tokenize_handler(seen, {"detail": "Not Found"}, 404), engine=engine)
        assert asyncio.run(call(target, lambda t: t.count_tokens("abc"))) is None
    assert [s["path"] for s in seen] == ["/tokenize"]
