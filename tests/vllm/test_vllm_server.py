"""Facts about a real vLLM server (0.32.0, CPU build) that kvcanary's vLLM support relies on.

Each test pins one behaviour that a probe or the scraper reads: the context limit and how an
over-long prompt is refused, token counting, the final usage chunk of a stream, prefix caching and
``cache_salt``, and the ``/metrics`` families. When vLLM changes one of them, a test here says
which. With KVCANARY_RECORD_VLLM=1 the tests also rewrite the recorded shapes in tests/fixtures/.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.vllm import FIXTURES, VllmServer, record

pytestmark = pytest.mark.vllm

# The families a vLLM scrape is read for (docs/engines.md section 3), beside cache_config_info.
SCRAPED_FAMILIES = (
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


@pytest.fixture(scope="module")
def client(vllm_server: VllmServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_server.url, timeout=30.0) as c:
        yield c


def complete(client: httpx.Client, model: str, prompt: str | list[int], **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}
    return client.post("/v1/completions", json=body)


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)


def test_models_reports_the_served_name_and_max_model_len(
    client: httpx.Client, vllm_server: VllmServer
) -> None:
    body = client.get("/v1/models").json()
    record("vllm/models.json", dump(body))
    (card,) = body["data"]
    assert card["id"] == vllm_server.model_name
    assert card["max_model_len"] == vllm_server.max_model_len == 1024


def test_tokenize_counts_prompt_tokens_including_bos(client: httpx.Client, vllm_server: VllmServer) -> None:
    response = client.post("/tokenize", json={"model": vllm_server.model_name, "prompt": "canary tenant"})
    body = response.json()
    record("vllm/tokenize.json", dump(body))
    assert response.status_code == 200
    assert body["count"] == len(body["tokens"]) > 1
    assert body["tokens"][0] == 0  # the tokenizer's BOS, added as for a completion
    assert body["max_model_len"] == 1024


def test_an_over_long_prompt_is_refused_with_400_naming_the_context_length(
    client: httpx.Client, vllm_server: VllmServer
) -> None:
    response = complete(client, vllm_server.model_name, "word " * 1100)
    body = response.json()
    record("vllm/error-context-length.json", dump(body))
    assert response.status_code == 400
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["code"] == 400
    message = body["error"]["message"]
    assert "maximum context length is 1024 tokens" in message
    assert "at least 1025 input tokens" in message  # vLLM stops counting one past the limit


def test_the_limit_is_exact_at_max_model_len_tokens(client: httpx.Client, vllm_server: VllmServer) -> None:
    # Token-id prompts make the length exact. 1,023 prompt tokens leave room for one output token.
    assert complete(client, vllm_server.model_name, [5] * 1023).status_code == 200
    over = complete(client, vllm_server.model_name, [5] * 1025)
    assert over.status_code == 400
    assert "maximum context length is 1024" in over.json()["error"]["message"]
    # A prompt of exactly max_model_len tokens leaves no room for output: vLLM clamps max_tokens
    # to 0 and refuses that instead, with a message that does not name the context length.
    full = complete(client, vllm_server.model_name, [5] * 1024)
    assert full.status_code == 400
    assert "max_tokens must be at least 1" in full.json()["error"]["message"]


def test_max_tokens_past_the_limit_is_clamped_not_refused(
    client: httpx.Client, vllm_server: VllmServer
) -> None:
    response = complete(client, vllm_server.model_name, [5] * 1000, max_tokens=100, ignore_eos=True)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == 1000
    assert usage["total_tokens"] == 1024


def test_a_streamed_chat_with_include_usage_ends_with_a_usage_chunk(
    client: httpx.Client, vllm_server: VllmServer
) -> None:
    body = {
        "model": vllm_server.model_name,
        "messages": [{"role": "user", "content": "Repeat exactly: 5f3a9c"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    record("vllm/chat-stream.sse", "\n\n".join(lines))
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    *content, last = chunks
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in content)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in content)
    assert text  # junk from random weights, but text
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6


def test_a_repeated_prompt_hits_the_prefix_cache_only_with_the_same_salt(
    client: httpx.Client, vllm_server: VllmServer
) -> None:
    model = vllm_server.model_name
    prompt = f"{uuid.uuid4().hex} " + "canary " * 300  # unique, so earlier tests cannot have cached it
    salt = uuid.uuid4().hex
    assert cached_tokens(complete(client, model, prompt, cache_salt=salt)) == 0
    hit = cached_tokens(complete(client, model, prompt, cache_salt=salt))
    assert hit > 0
    assert hit % vllm_server.block_size == 0  # only full blocks are shared
    assert cached_tokens(complete(client, model, prompt, cache_salt="other-" + salt)) == 0
    assert cached_tokens(complete(client, model, prompt)) == 0  # no salt is a salt of its own


def test_an_empty_cache_salt_is_refused(client: httpx.Client, vllm_server: VllmServer) -> None:
    response = complete(client, vllm_server.model_name, "hello", cache_salt="")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"


def scrape(client: httpx.Client) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.text


def test_metrics_expose_the_kv_pool_in_cache_config_info(
    client: httpx.Client, vllm_server: VllmServer
) -> None:
    text = scrape(client)
    # Recorded last in this module, so that the request counters in the fixture are not all zero.
    record("metrics/vllm.txt", text)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["vllm:cache_config_info"].samples
    labels = sample.labels
    assert sample.value == 1.0
    assert labels["block_size"] == str(vllm_server.block_size)
    assert int(labels["num_gpu_blocks"]) > 0
    # VLLM_CPU_KVCACHE_SPACE=1 (GiB): 1,048,576 float32 tokens for this model, in 32-token blocks.
    assert int(labels["kv_cache_size_tokens"]) == int(labels["num_gpu_blocks"]) * vllm_server.block_size
    assert labels["enable_prefix_caching"] == "True"
    assert [name for name in SCRAPED_FAMILIES if name not in families] == []


def test_the_recorded_metrics_fixture_matches_the_live_families(client: httpx.Client) -> None:
    recorded_path = FIXTURES / "metrics" / "vllm.txt"
    recorded = {f.name: f.type for f in text_string_to_metric_families(recorded_path.read_text())}
    live = {f.name: f.type for f in text_string_to_metric_families(scrape(client))}
    vllm_only = {n: t for n, t in recorded.items() if n.startswith("vllm:")}
    assert vllm_only, "the fixture has no vllm: families"
    stale = {n: t for n, t in vllm_only.items() if live.get(n) != t}
    assert stale == {}, "re-record with KVCANARY_RECORD_VLLM=1 pytest tests/vllm"
