"""Facts about the SGLang engine itself (0.5.23, aggregated, CPU) that kvcanary's SGLang support
reads (``monitor/targets/capacity.py``, ``probes/engine_counters.py``; ``docs/engines.md``).

Each test pins one shape: where the pool, the window and the version are published, the radix
cache's hits in ``usage``, how an over-long prompt is refused (aggregated: a 400, never the
placeholder of sglang#30233, which was prefill/decode only), and the ``/metrics`` families. When
SGLang changes one of them, a test here says which.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sglang.server import VERSION, SglangServer

pytestmark = pytest.mark.xdist_group("sglang")


@pytest.fixture(scope="session")
def client(sglang_server: SglangServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sglang_server.url, timeout=60.0) as c:
        yield c


def metric_values(client: httpx.Client) -> dict[str, float]:
    """Return each ``sglang:`` sample's value by sample name (one engine: one series each here)."""
    text = client.get("/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("sglang:")
    }


def send_twice(client: httpx.Client, server: SglangServer) -> list[dict[str, Any]]:
    """Send one new prompt twice; return the two answers' usage."""
    prompt = f"{uuid.uuid4().hex}: " + "the shared prefix of two requests. " * 8
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return [client.post("/v1/completions", json=body).json()["usage"] for _ in range(2)]


def test_server_info_states_the_pool_and_version_but_no_context_length(
    client: httpx.Client, sglang_server: SglangServer
) -> None:
    info = client.get("/server_info").json()
    assert info["max_total_num_tokens"] == sglang_server.kv_pool_tokens
    assert info["context_length"] is None  # the server argument, unset: SGLang took the model's
    assert info["max_req_input_len"] == sglang_server.context_len - 6
    assert (info["page_size"], info["version"], info["disaggregation_mode"]) == (1, VERSION, "null")


def test_models_and_metrics_state_the_context_window(
    client: httpx.Client, sglang_server: SglangServer
) -> None:
    (card,) = client.get("/v1/models").json()["data"]
    assert (card["id"], card["max_model_len"]) == (sglang_server.model_name, sglang_server.context_len)
    values = metric_values(client)
    assert values["sglang:context_len"] == sglang_server.context_len
    assert values["sglang:max_total_num_tokens"] == sglang_server.kv_pool_tokens


def test_a_repeated_prompt_is_served_from_the_radix_cache_but_its_last_token(
    client: httpx.Client, sglang_server: SglangServer
) -> None:
    first, second = send_twice(client, sglang_server)
    # The first finds at most the BOS every prompt shares; the repeat all but the token whose
    # logits the engine must compute.
    assert first["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"] // 2, first
    assert second["prompt_tokens_details"]["cached_tokens"] == second["prompt_tokens"] - 1, second


def test_an_over_long_prompt_is_refused_with_400_naming_the_context_length(
    client: httpx.Client, sglang_server: SglangServer
) -> None:
    body = {"model": sglang_server.model_name, "prompt": "canary tenant word " * 700, "max_tokens": 4}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert (
        f"longer than the model's context length ({sglang_server.context_len} tokens)"
        in (response.json()["message"])
    )


def test_metrics_carry_the_prefix_cache_counters_kvcanary_maps_for_sglang(
    client: httpx.Client, sglang_server: SglangServer
) -> None:
    send_twice(client, sglang_server)  # cached_tokens_total is labelled: it appears with a first hit
    values = metric_values(client)
    assert {"sglang:prompt_tokens_total", "sglang:cached_tokens_total"} <= set(values), sorted(values)
