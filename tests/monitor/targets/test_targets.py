"""OpenAIHttpTarget against the engines' real wire shapes, faked only at the network seam (MockTransport).

The bodies below are the shapes recorded in ``docs/engines.md``: vLLM's and SGLang's 400s,
llama.cpp's ``exceed_context_size_error``, streamed chunks with ``include_usage``, and vLLM's
``vllm:cache_config_info`` metric.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.targets.openai_http import ERROR_BODY_BYTES, OpenAIHttpTarget
from kvcanary.probes.target import CompletionRequest
from tests.probes.probe_harness import loopback_target
from tests.support import free_port

KEY = "sk-alice-0123456789abcdef"
Handler = Callable[[httpx.Request], httpx.Response]


def make_target(
    handler: Handler,
    *,
    engine: str = "vllm",
    timeout: float = 5.0,
    options: dict[str, Any] | None = None,
    base_url: str = "http://engine.test:8000",
    keys: dict[str, str | None] | None = None,
) -> OpenAIHttpTarget:
    config = TargetConfig(
        name="t1",
        base_url=base_url,
        engine=engine,
        model="m",
        tenants=[{"name": "alice"}, {"name": "bob"}],
        timeout_seconds=timeout,
        options=options or {},
    )
    keys = keys if keys is not None else {"alice": KEY, "bob": None}
    return loopback_target(config, keys, handler)


async def call(target: OpenAIHttpTarget, coro_fn: Callable[[OpenAIHttpTarget], Any]) -> Any:
    async with target:
        return await coro_fn(target)


def complete(
    handler: Handler, request: CompletionRequest | None = None, tenant: str = "alice", **kw: Any
) -> Any:
    request = request or CompletionRequest("hello", max_tokens=8)
    return asyncio.run(call(make_target(handler, **kw), lambda t: t.complete(tenant, request)))


def sse(*chunks: dict[str, Any] | str, done: bool = True) -> httpx.Response:
    lines = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks]
    if done:
        lines.append("data: [DONE]\n\n")
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content="".join(lines).encode())


def delta(content: str | None, finish: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }


USAGE_CHUNK = {
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    },
}
VLLM_400 = {
    "error": {
        "message": "This model's maximum context length is 8192 tokens. However, you requested 64 output "
        "tokens and your prompt contains at least 8193 input tokens, for a total of at least 8257 tokens.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}
SGLANG_400 = {
    "object": "error",
    "message": "Input length (681281 tokens) exceeds the maximum allowed length (681274 tokens). "
    "Use a shorter input or enable --allow-auto-truncate.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
LLAMACPP_400 = {
    "error": {
        "code": 400,
        "message": "request (4100 tokens) exceeds the available context size (4096 tokens), "
        "try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 4100,
        "n_ctx": 4096,
    }
}


# --- completions ----------------------------------------------------------------------------------------


def test_a_streamed_chat_answer_is_concatenated_with_usage_and_time_to_first_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return sse(delta(""), delta("Hel"), delta("lo"), delta(None, "stop"), USAGE_CHUNK)

    c = complete(handler, CompletionRequest("hi", max_tokens=8, system="be brief", seed=7))
    assert (c.status, c.text, c.finish_reason) == (200, "Hello", "stop")
    assert (c.prompt_tokens, c.completion_tokens, c.cached_tokens) == (12, 3, 4)
    assert c.error is None and c.error_kind is None
    assert c.ttft_seconds is not None and 0 <= c.ttft_seconds <= c.latency_seconds
    body = json.loads(seen[0].content)
    assert seen[0].url.path == "/v1/chat/completions"
    assert seen[0].headers["authorization"] == f"Bearer {KEY}"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"], body["temperature"], body["seed"], body["stream"]) == (
        "m",
        8,
        0.0,
        7,
        True,
    )


def test_a_raw_completion_without_stream_is_parsed_from_the_json_body() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200,
            json={
                "choices": [{"text": "abc", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3},
            },
        )

    c = complete(handler, CompletionRequest("p", chat=False, stream=False))
    assert (c.status, c.text, c.prompt_tokens, c.finish_reason, c.ttft_seconds) == (
        200,
        "abc",
        5,
        "length",
        None,
    )
    body = json.loads(seen[0].content)
    assert seen[0].url.path == "/v1/completions"
    assert body["prompt"] == "p" and "stream_options" not in body


def test_a_streamed_completion_reads_choice_text() -> None:
    chunks = [{"choices": [{"text": t, "finish_reason": f}]} for t, f in (("a", None), ("b", "stop"))]
    c = complete(lambda r: sse(*chunks), CompletionRequest("p", chat=False))
    assert (c.text, c.finish_reason) == ("ab", "stop")


def test_a_tenant_without_a_key_sends_no_authorization_header() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return sse(delta("x", "stop"))

    complete(handler, tenant="bob")
    assert "authorization" not in seen[0].headers


def test_a_base_url_written_with_v1_is_not_doubled() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return sse(delta("x", "stop"))

    complete(handler, base_url="http://engine.test:8000/v1")
    assert seen == ["/v1/chat/completions"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (VLLM_400, "This model's maximum context length is 8192 tokens"),
        (SGLANG_400, "Input length (681281 tokens) exceeds the maximum allowed length"),
        (LLAMACPP_400, "request (4100 tokens) exceeds the available context size"),
        (
            {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 9, "n_ctx": 8}},
            "exceed_context_size_error: request (9 tokens) exceeds the context size (8 tokens)",
        ),
        ({"detail": "Not Found"}, "Not Found"),
    ],
    ids=["vllm", "sglang", "llamacpp", "llamacpp-old", "fastapi"],
)
def test_an_error_body_keeps_its_raw_text_and_the_engines_message(body: dict[str, Any], message: str) -> None:
    raw = json.dumps(body)
    c = complete(lambda r: httpx.Response(400, content=raw.encode()))
    assert (c.status, c.error_kind, c.text) == (400, "http", raw)
    assert c.error is not None and c.error.startswith(message)
    assert c.refused and not c.ok


def test_llamacpp_refusals_report_the_prompt_length_they_counted() -> None:
    c = complete(lambda r: httpx.Response(400, json=LLAMACPP_400), engine="llamacpp")
    assert c.prompt_tokens == 4100


def test_an_error_body_is_bounded_and_a_non_json_one_still_gets_a_message() -> None:
    c = complete(lambda r: httpx.Response(502, content=b"<html>" + b"x" * 100_000))
    assert (c.status, c.error_kind) == (502, "foreign")
    assert c.error is not None and c.error.startswith("HTTP 502")
    assert len(c.text.encode()) == ERROR_BODY_BYTES


def test_a_proxys_413_page_is_not_an_engine_refusal() -> None:
    c = complete(lambda r: httpx.Response(413, content=b"<html>413 Request Entity Too Large</html>"))
    assert (c.status, c.error_kind, c.refused) == (413, "foreign", False)


def test_a_refused_connection_is_status_none_and_connect() -> None:
    config = TargetConfig(
        name="t1", base_url=f"http://127.0.0.1:{free_port()}", tenants=[{"name": "alice"}], probes=["canary"]
    )
    target = OpenAIHttpTarget(config, {"alice": KEY})
    c = asyncio.run(call(target, lambda t: t.complete("alice", CompletionRequest("hi"))))
    assert (c.status, c.error_kind, c.text) == (None, "connect", "")
    assert "cannot connect" in (c.error or "")


def test_a_server_that_accepts_and_never_answers_is_a_timeout() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)  # the kernel accepts; nothing ever reads or writes
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        config = TargetConfig(
            name="t1", base_url=url, tenants=[{"name": "alice"}], probes=["canary"], timeout_seconds=0.3
        )
        target = OpenAIHttpTarget(config, {"alice": KEY})
        c = asyncio.run(call(target, lambda t: t.complete("alice", CompletionRequest("hi"))))
    assert (c.status, c.error_kind) == (None, "timeout")


def test_an_answer_slower_than_the_targets_timeout_is_a_timeout() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return sse(delta("late", "stop"))

    c = complete(slow, timeout=0.2)  # type: ignore[arg-type]
    assert (c.status, c.error_kind) == (None, "timeout")
    assert c.latency_seconds is not None and c.latency_seconds < 2


@pytest.mark.parametrize(
    "response",
    [
        sse(delta("a"), "not json"),
        sse(delta("a"), done=False),
        sse(done=False),
        httpx.Response(200, content=b"<html>oops</html>"),
        httpx.Response(200, json={"choices": []}),
        httpx.Response(200, json={"choices": "nope"}),
    ],
    ids=["non-json-chunk", "cut-stream", "empty-stream", "html-body", "no-choices", "choices-not-list"],
)
def test_a_malformed_body_or_stream_is_a_protocol_error(response: httpx.Response) -> None:
    c = complete(lambda r: response)
    assert (c.status, c.error_kind) == (200, "protocol")
    assert not c.refused


def test_an_error_inside_a_200_stream_is_a_stream_error_and_its_text_is_kept_for_scanning() -> None:
    err = {
        "error": {"message": "The input (9000 tokens) is longer than the model's context length", "code": 400}
    }
    c = complete(lambda r: sse(delta("pa"), err))
    assert (c.status, c.error_kind) == (200, "stream")
    assert c.error is not None and c.error.startswith("The input (9000 tokens)")
    assert c.text.startswith("pa") and "longer than" in c.text


def thinking(reasoning: str | None, content: str | None, both_names: bool = False) -> dict[str, Any]:
    """A reasoning model's delta; ``both_names``: the same thought under both field names (vLLM while
    it renamed ``reasoning_content`` to ``reasoning``)."""
    piece: dict[str, Any] = {"content": content, "reasoning_content": reasoning}
    if both_names:
        piece["reasoning"] = reasoning
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": piece}]}


@pytest.mark.parametrize("both_names", [False, True])
def test_markers_sent_in_pieces_through_reasoning_and_answer_come_out_whole(both_names: bool) -> None:
    thought, answer = "KVC-0badc0de-" + "a" * 32, "KVC-12345678-" + "b" * 32
    pieces = [(thought[i : i + 6], answer[i : i + 6]) for i in range(0, len(answer), 6)]
    c = complete(lambda r: sse(*(thinking(t, a, both_names) for t, a in pieces), USAGE_CHUNK))
    assert c.error_kind is None
    assert c.text.count(thought) == 1 and c.text.count(answer) == 1, c.text


@pytest.mark.parametrize("broken", ["data: not json", 'data: {"error": {"message": "boom"}}'])
def test_what_a_broken_stream_sends_after_the_break_is_still_scanned(broken: str) -> None:
    marker = "KVC-0badc0de-" + "c" * 32
    after_break = f"data: {json.dumps(delta(marker))}\n\n"
    body = f"data: {json.dumps(delta('pa'))}\n\n{broken}\n\n{after_break}data: [DONE]\n\n"
    c = complete(lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body))
    assert c.error_kind in ("protocol", "stream")
    assert marker in c.text


def test_a_marker_inside_a_chunk_that_is_not_json_is_scanned() -> None:
    marker = "KVC-0badc0de-" + "d" * 32
    c = complete(lambda r: sse(delta("pa"), f"<html>{marker}</html>"))
    assert c.error_kind == "protocol" and marker in c.text


def test_a_short_key_never_cuts_a_marker_apart() -> None:
    # A toy engine's 4-hex-digit key occurs inside about one marker in 2,000: scrubbed, the marker
    # would be cut and its leak unseen (or its canary's nonce "missing").
    marker = "KVC-0123abcd-" + "ffff" * 4 + "beef" + "0" * 12
    c = complete(lambda r: sse(delta(marker)), keys={"alice": "beef", "bob": "cafe"})
    assert c.text == marker


def test_the_api_key_never_appears_in_text_or_error() -> None:
    def echo_key(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            401, json={"error": {"message": f"Invalid key {request.headers['authorization']}"}}
        )

    def proxy_page_with_key(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text=f"<html>upstream refused {request.headers['authorization']}</html>")

    for handler in (echo_key, proxy_page_with_key):
        c = complete(handler)
        assert KEY not in repr(c)
        assert "<api-key>" in (c.error or "") + c.text
