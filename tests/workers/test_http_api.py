"""The OpenAI-compatible surface, in-process: echo, chat, streams, usage, models, tokenize, server info."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from tests.workers.support import MODEL, complete


def sse_events(body: str) -> list[Any]:
    """Return the decoded ``data:`` payloads of an SSE body; ``[DONE]`` stays a string."""
    events = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_it_echoes_the_prompt_and_reports_usage(serve: Callable[..., TestClient]) -> None:
    client = serve()
    body = complete(client, "Hello, kvcanary!", max_tokens=64).json()
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert body["choices"][0]["text"] == "Hello, kvcanary!"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 16, "completion_tokens": 16, "total_tokens": 32}


def test_it_stops_at_max_tokens_with_finish_reason_length(serve: Callable[..., TestClient]) -> None:
    body = complete(serve(), "abcdefghij", max_tokens=4).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("abcd", "length")


def test_it_defaults_max_tokens_to_16(serve: Callable[..., TestClient]) -> None:
    body = complete(serve(), "x" * 40).json()
    assert body["usage"]["completion_tokens"] == 16


def test_it_echoes_multibyte_text_intact(serve: Callable[..., TestClient]) -> None:
    body = complete(serve(), "naïve café — 東京", max_tokens=100).json()
    assert body["choices"][0]["text"] == "naïve café — 東京"


def test_it_answers_chat_by_echoing_the_rendered_messages(serve: Callable[..., TestClient]) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    response = serve().post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 50}
    )
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "be brief\nhi"}
    assert body["usage"]["prompt_tokens"] == len("be brief\nhi")


def test_it_streams_completions_with_a_usage_chunk(serve: Callable[..., TestClient]) -> None:
    response = complete(
        serve(), "stream me", max_tokens=50, stream=True, stream_options={"include_usage": True}
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] == 9
    assert "".join(c["choices"][0]["text"] for c in chunks) == "stream me"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks)


def test_it_streams_chat_deltas_starting_with_the_role(serve: Callable[..., TestClient]) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "héllo"}], "stream": True}
    events = sse_events(serve().post("/v1/chat/completions", json=payload).text)
    chunks = events[:-1]
    assert events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "héllo"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


def test_it_lists_its_model_with_the_context_window(serve: Callable[..., TestClient]) -> None:
    body = serve(served_model_name="tiny").get("/v1/models").json()
    assert [(m["id"], m["max_model_len"]) for m in body["data"]] == [("tiny", 8192)]


def test_it_tokenizes_prompts_and_messages_as_bytes(serve: Callable[..., TestClient]) -> None:
    client = serve()
    assert client.post("/tokenize", json={"prompt": "hé"}).json() == {
        "tokens": [104, 195, 169],
        "count": 3,
        "max_model_len": 8192,
    }
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    assert client.post("/tokenize", json={"messages": messages}).json()["tokens"] == [97, 10, 98]


def test_it_describes_an_aggregated_node_like_sglang(serve: Callable[..., TestClient]) -> None:
    client = serve(mode="aggregated", kv_pool_tokens=1024)
    info = client.get("/get_server_info").json()
    assert info == client.get("/server_info").json()
    assert info["context_length"] == 8192
    assert info["max_total_num_tokens"] == 1024
    assert info["max_req_input_len"] == 1023
    assert info["disaggregation_mode"] == "null"
    assert info["kv_pools"] == {"unified": 1024}
    assert info["admission"] == "reject"
    assert info["status"] == "ready"
    assert info["version"].startswith("kvcanary-reference ")


def test_it_describes_a_disaggregated_node_by_its_prefill_pool(serve: Callable[..., TestClient]) -> None:
    info = (
        serve(mode="disaggregated", admission="placeholder", verify_ownership=True)
        .get("/get_server_info")
        .json()
    )
    assert info["disaggregation_mode"] == "prefill"
    assert info["kv_pools"] == {"prefill": 1024, "decode": 4096}
    assert (info["max_total_num_tokens"], info["max_req_input_len"]) == (1024, 1023)
    assert (info["admission"], info["verify_ownership"], info["zero_freed_pages"]) == (
        "placeholder",
        True,
        False,
    )
    assert info["page_size"] == 16


def test_it_answers_health(serve: Callable[..., TestClient]) -> None:
    assert serve().get("/health").status_code == 200


def test_it_reports_cached_tokens_only_with_the_prefix_cache_on(serve: Callable[..., TestClient]) -> None:
    prompt = "p" * 50  # three whole pages and two tokens
    plain = complete(serve(), prompt).json()["usage"]
    assert "prompt_tokens_details" not in plain
    client = serve(prefix_cache="per-tenant")
    first = complete(client, prompt, key="alice").json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = complete(client, prompt, key="alice").json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": 48}
    assert again["prompt_tokens"] == 50
    assert complete(client, prompt, key="bob").json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_it_streams_cached_tokens_in_the_usage_chunk(serve: Callable[..., TestClient]) -> None:
    client = serve(prefix_cache="shared")
    messages = [{"role": "user", "content": "c" * 40}]
    payload = {"model": MODEL, "messages": messages, "cache_salt": "team-1"}
    client.post("/v1/chat/completions", json=payload)
    streamed = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(client.post("/v1/chat/completions", json=streamed).text)
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    other_salt = {**streamed, "cache_salt": "team-2"}
    events = sse_events(client.post("/v1/chat/completions", json=other_salt).text)
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_it_accepts_cache_salt_with_the_prefix_cache_off(serve: Callable[..., TestClient]) -> None:
    body = complete(serve(), "salted", cache_salt="s", max_tokens=10).json()
    assert body["choices"][0]["text"] == "salted"


def test_it_names_its_prefix_cache_mode_in_server_info(serve: Callable[..., TestClient]) -> None:
    assert serve().get("/get_server_info").json()["prefix_cache"] == "off"
    info = serve(mode="disaggregated", prefix_cache="per-tenant").get("/get_server_info").json()
    assert info["prefix_cache"] == "per-tenant"


def test_the_deprecated_single_mode_runs_as_aggregated_under_0_1s_wire_names(
    serve: Callable[..., TestClient],
) -> None:
    """``--mode single`` (0.1's name, refused in 0.3) keeps ``pool="single"``, so 0.1's queries match."""
    old, new = serve(mode="single", kv_pool_tokens=1024), serve(mode="aggregated", kv_pool_tokens=1024)
    old_info, new_info = old.get("/get_server_info").json(), new.get("/get_server_info").json()
    assert old_info["kv_pools"] == {"single": 1024}
    assert {k: v for k, v in old_info.items() if k != "kv_pools"} == {
        k: v for k, v in new_info.items() if k != "kv_pools"
    }
    assert 'kvcanary_kv_pool_tokens{pool="single"} 1024.0' in old.get("/metrics").text
    assert 'kvcanary_kv_pool_tokens{pool="unified"} 1024.0' in new.get("/metrics").text
