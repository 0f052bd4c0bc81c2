"""The context limit of a real llama-cpp-python server (0.3.36): how it refuses, clamps and breaks.

The server never reports its context size; only the 400 for an over-long prompt names it, and the
boundary probe and the llama.cpp adapter read it from there. README.md here lists the shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.llamacpp.calls import CONTEXT_MESSAGE, FIRST_BYTE_TOKEN, chat, complete, count_tokens
from tests.support.llamacpp import LlamaCppServer

pytestmark = pytest.mark.llamacpp


def test_an_over_long_prompt_is_refused_with_400_context_length_exceeded(
    client: httpx.Client, llamacpp_server: LlamaCppServer
) -> None:
    prompt = "canary " * 300  # 302 tokens: BOS, 300 words, the trailing space
    response = complete(client, prompt, max_tokens=4)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "This model's maximum context length is 256 tokens, however you requested 306 tokens "
            "(302 in your prompt; 4 for the completion). Please reduce your prompt; or completion length.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    response = chat(client, prompt, max_tokens=4)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(
        f"This model's maximum context length is {llamacpp_server.n_ctx} tokens. However, you requested "
    )
    assert "in the messages, 4 in the completion). Please reduce the length" in error["message"]


def test_the_limit_refuses_a_prompt_of_exactly_n_ctx_tokens(
    client: httpx.Client, llamacpp_server: LlamaCppServer
) -> None:
    n_ctx = llamacpp_server.n_ctx
    fits = "canary " * (n_ctx - 3)  # BOS + words + trailing space = n_ctx - 1 tokens
    assert count_tokens(client, fits) == n_ctx - 1
    assert complete(client, fits, max_tokens=1).status_code == 200
    full = "canary " * (n_ctx - 2)
    assert count_tokens(client, full) == n_ctx
    response = complete(client, full, max_tokens=1)
    assert response.status_code == 400
    assert f"({n_ctx} in your prompt; 1 for the completion)" in response.json()["error"]["message"]


def test_max_tokens_past_the_limit_is_clamped_not_refused(
    client: httpx.Client, llamacpp_server: LlamaCppServer
) -> None:
    prompt = "canary " * 249  # 251 tokens
    response = complete(client, prompt, max_tokens=20)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 251, "completion_tokens": 5, "total_tokens": 256}
    assert llamacpp_server.n_ctx == 256


def test_an_over_long_streamed_prompt_answers_200_with_no_events(llamacpp_server: LlamaCppServer) -> None:
    # The error is raised inside the event stream, after the 200 headers went out; the server then
    # drops the connection (a fresh client, so that no other test reuses it).
    body = {"model": "tiny", "prompt": "canary " * 300, "max_tokens": 4, "stream": True}
    with (
        httpx.Client(base_url=llamacpp_server.url, timeout=30.0) as fresh,
        fresh.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        try:
            raw = response.read()
        except httpx.RemoteProtocolError:
            raw = b""
    assert b"data:" not in raw


def test_output_ending_mid_utf8_runs_past_max_tokens_until_the_context_is_full(client: httpx.Client) -> None:
    # llama-cpp-python holds back tokens that end inside a UTF-8 sequence and skips its max_tokens
    # check for them. Forcing the lead byte 0xE2 every step never completes a character, so the
    # generation runs into the end of the KV cache and llama_decode fails.
    bias = {str(FIRST_BYTE_TOKEN + 0xE2): 100}
    response = complete(client, "canary tenant", max_tokens=2, logit_bias=bias)
    assert response.status_code == 500
    error = {
        "message": "llama_decode returned 1",
        "type": "internal_server_error",
        "param": None,
        "code": None,
    }
    assert response.json() == {"error": error}
    assert complete(client, "canary tenant").status_code == 200  # the server recovers


@pytest.mark.parametrize("n_ctx", [512, 2048])
def test_the_context_size_can_be_read_only_from_the_400_message(
    llamacpp_servers: Callable[..., LlamaCppServer], n_ctx: int
) -> None:
    server = llamacpp_servers(n_ctx=n_ctx)
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        response = complete(c, "canary " * n_ctx, max_tokens=1)
        assert response.status_code == 400
        match = CONTEXT_MESSAGE.search(response.json()["error"]["message"])
        assert match is not None and int(match.group(1)) == n_ctx
        assert complete(c, "canary " * (n_ctx - 3), max_tokens=1).status_code == 200


def test_an_n_ctx_off_a_multiple_of_256_is_padded_and_breaks_in_between(
    llamacpp_servers: Callable[..., LlamaCppServer],
) -> None:
    # llama.cpp rounds the context up to a multiple of 256; llama-cpp-python checks prompts against
    # the padded size but keeps buffers of the size asked for. Prompts or outputs that reach past
    # --n_ctx but stay within the padding fail with a numpy error (500); the 400 names the padding.
    server = llamacpp_servers(n_ctx=128)
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        over = complete(c, "canary " * 300, max_tokens=1)
        assert over.status_code == 400
        assert "maximum context length is 256 tokens" in over.json()["error"]["message"]
        assert complete(c, "canary " * 126, max_tokens=1).status_code == 200  # 128 tokens
        between = complete(c, "canary " * 150, max_tokens=1)
        assert between.status_code == 500
        assert between.json()["error"]["message"].startswith("could not broadcast input array from shape")
        runs_past = complete(c, "canary " * 98, max_tokens=100)  # 100 + 100 tokens, clamped to 256
        assert runs_past.status_code == 500
        assert runs_past.json()["error"]["type"] == "internal_server_error"
