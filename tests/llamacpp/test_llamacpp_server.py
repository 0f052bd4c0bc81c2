"""Facts about a real llama-cpp-python server (0.3.36) that kvcanary's llama.cpp support relies on.

This is llama-cpp-python's FastAPI server, not llama.cpp's C++ ``llama-server`` (docs/engines.md
section 4): no ``/props``, ``/slots`` or ``/metrics``, a tokenizer under ``/extras``, usage without
``prompt_tokens_details``, and one request at a time. The context size is never reported; only the
400 for an over-long prompt names it (test_llamacpp_context.py). Each test pins one behaviour that an
adapter or a probe reads; when llama-cpp-python changes one, a test here says which. README.md here
lists the shapes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.llamacpp.calls import BOS, EOS, chat, complete, count_tokens, stream_lines, text_of
from tests.support.llamacpp import LlamaCppServer

pytestmark = pytest.mark.llamacpp

RUNS = 20


# --- what the server tells about itself ----------------------------------------------------------


def test_models_lists_the_alias_and_nothing_about_the_context(client: httpx.Client) -> None:
    assert client.get("/v1/models").json() == {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "owned_by": "me", "permissions": []}],
    }


@pytest.mark.parametrize("path", ["/props", "/slots", "/metrics", "/health", "/v1/props", "/version"])
def test_llama_server_introspection_endpoints_do_not_exist(client: httpx.Client, path: str) -> None:
    response = client.get(path)
    assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})


def test_the_api_is_exactly_openai_plus_the_extras_tokenizer(client: httpx.Client) -> None:
    paths = {path: sorted(ops) for path, ops in client.get("/openapi.json").json()["paths"].items()}
    assert paths == {
        "/v1/completions": ["post"],
        "/v1/chat/completions": ["post"],
        "/v1/embeddings": ["post"],
        "/v1/models": ["get"],
        "/extras/tokenize": ["post"],
        "/extras/tokenize/count": ["post"],
        "/extras/detokenize": ["post"],
    }
    assert client.post("/tokenize", json={"content": "x"}).status_code == 404  # llama-server's path


# --- tokenizer ---------------------------------------------------------------------------------------


def test_tokenize_takes_input_and_returns_ids_with_bos(client: httpx.Client) -> None:
    tokens = client.post("/extras/tokenize", json={"input": "canary tenant"}).json()["tokens"]
    assert tokens[0] == BOS and len(tokens) == 3  # both words are single pieces in the tiny vocabulary
    assert client.post("/extras/tokenize", json={"model": "tiny", "input": "canary tenant"}).json() == {
        "tokens": tokens
    }
    assert client.post("/extras/tokenize", json={"input": ""}).json() == {"tokens": [BOS]}
    # Special tokens in the text are parsed (special=True): "<s>" becomes BOS, not characters.
    assert client.post("/extras/tokenize", json={"input": "<s></s>"}).json() == {"tokens": [BOS, BOS, EOS]}
    assert client.post("/extras/tokenize/count", json={"input": "canary tenant"}).json() == {"count": 3}
    assert client.post("/extras/detokenize", json={"tokens": tokens}).json() == {"text": "canary tenant"}


def test_tokenize_count_equals_the_prompt_tokens_of_a_completion(client: httpx.Client) -> None:
    for prompt in ("x", "canary tenant", "the secret is 5f3a9c-77 " * 5):
        usage = complete(client, prompt, max_tokens=1).json()["usage"]
        assert usage["prompt_tokens"] == count_tokens(client, prompt)


def test_a_malformed_tokenize_request_is_a_500_not_a_422(client: httpx.Client) -> None:
    response = client.post("/extras/tokenize", json={"prompt": "x"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_server_error"
    assert error["message"].startswith("1 validation error:")
    assert "'loc': ('body', 'input')" in error["message"]


# --- completions and chat --------------------------------------------------------------------------


def test_a_completion_reports_usage_without_cached_tokens(client: httpx.Client) -> None:
    body = complete(client, "canary tenant", model="any-name").json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "any-name"  # the single model answers any name, and echoes it
    (choice,) = body["choices"]
    assert choice == {"text": choice["text"], "index": 0, "logprobs": None, "finish_reason": "length"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


def test_a_chat_completion_counts_the_rendered_template(client: httpx.Client) -> None:
    body = chat(client, "hi").json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    # The GGUF's chat template starts with {{ bos_token }}; the server does not add a second one.
    rendered = "<s><|user|>\nhi</s>\n<|assistant|>\n"
    assert body["usage"]["prompt_tokens"] == count_tokens(client, rendered) - 1


def test_a_completion_accepts_only_text_prompts(client: httpx.Client) -> None:
    assert text_of(complete(client, ["canary tenant"])) == text_of(complete(client, "canary tenant"))
    response = complete(client, [BOS, 5, 6])
    assert response.status_code == 500  # a validation error, reported as an internal one
    assert response.json()["error"]["type"] == "internal_server_error"


def test_unknown_fields_such_as_cache_salt_are_ignored(client: httpx.Client) -> None:
    plain = complete(client, "canary tenant")
    salted = complete(client, "canary tenant", cache_salt="tenant-a", cache_prompt=False)
    assert salted.status_code == 200 and text_of(salted) == text_of(plain)


def test_a_streamed_completion_has_no_usage_even_when_asked(client: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "canary tenant", "max_tokens": 8, "temperature": 0}
    lines = stream_lines(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    plain = text_of(client.post("/v1/completions", json=body))
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain


def test_a_streamed_chat_sends_a_role_delta_then_content_and_no_usage(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    lines = stream_lines(client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert "".join(d.get("content", "") for d in deltas) == plain


def test_a_seed_makes_sampling_repeatable(client: httpx.Client) -> None:
    seeded = {text_of(complete(client, "canary tenant", temperature=0.9, seed=7)) for _ in range(3)}
    assert len(seeded) == 1


# --- one request at a time ------------------------------------------------------------------------------


def test_a_repeated_prefix_is_reused_but_only_the_log_says_so(
    client: httpx.Client, llamacpp_server: LlamaCppServer
) -> None:
    # The server keeps the KV cache of the previous request (one sequence) and reuses the longest
    # common prefix. Usage does not show it; the server's stderr does.
    first, second = "the tenant secret is 4711", "the tenant secret is 5f3a"
    ids = [client.post("/extras/tokenize", json={"input": p}).json()["tokens"] for p in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    complete(client, first, max_tokens=1)
    before = llamacpp_server.log_text().count("prefix-match hit")
    usage = complete(client, second, max_tokens=1).json()["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    log = llamacpp_server.log_text()
    assert log.count("prefix-match hit") == before + 1
    hit = f"Llama.generate: {shared} prefix-match hit, remaining {len(ids[1]) - shared} prompt tokens to eval"
    assert hit in log


def _stream_with_a_second_request(server: LlamaCppServer) -> tuple[list[dict[str, Any]], bool, bool, bool]:
    """Stream a long completion and send another request after its first event.

    Return the stream's chunks, whether it sent [DONE], whether the HTTP body ended cleanly, and
    whether the stream was still being read when the other request was sent.
    """
    body = {"model": "tiny", "prompt": "canary tenant", "max_tokens": 1000, "temperature": 0, "stream": True}
    chunks: list[dict[str, Any]] = []
    done = clean = False
    first, finished = threading.Event(), threading.Event()

    def read() -> None:
        nonlocal done, clean
        try:
            with (
                httpx.Client(base_url=server.url, timeout=60.0) as c,
                c.stream("POST", "/v1/completions", json=body) as response,
            ):
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                        finished.set()
                    elif line.startswith("data: "):
                        chunks.append(json.loads(line.removeprefix("data: ")))
                        first.set()
                        if chunks[-1]["choices"][0]["finish_reason"] is not None:
                            finished.set()
            clean = True
        except httpx.RemoteProtocolError:
            pass
        finally:
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(30)
    overlapped = not finished.is_set()  # else the answer was whole before the other request went
    other = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60.0)
    reader.join(60)
    assert other.status_code == 200
    return chunks, done, clean, overlapped


def _overlapping_stream(server: LlamaCppServer) -> tuple[list[dict[str, Any]], bool, bool]:
    """A stream that a second request met while it ran: on a loaded machine the whole answer may
    be out before the second request is sent, which shows nothing; that try is made again."""
    for _ in range(3):
        chunks, done, clean, overlapped = _stream_with_a_second_request(server)
        if overlapped:
            return chunks, done, clean
    pytest.fail("in three tries the stream ended before a second request could meet it")


def test_a_new_request_cuts_a_running_stream_short(llamacpp_servers: Callable[..., LlamaCppServer]) -> None:
    # --interrupt_requests is on by default: a request that arrives while a stream runs makes the
    # server send [DONE] at once, with no chunk carrying a finish_reason. Whether the HTTP body then
    # ends cleanly depends on its HTTP stack's versions (starlette 1.10 and sse-starlette 3.7 end it;
    # earlier ones dropped the connection): a probe that streams must treat "no finish_reason" as
    # cut short, whatever the body's end.
    chunks, done, _ = _overlapping_stream(llamacpp_servers(n_ctx=2048))
    assert done
    assert 0 < len(chunks) < 1000
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_without_interrupt_requests_a_stream_waits_out_other_requests(
    llamacpp_servers: Callable[..., LlamaCppServer],
) -> None:
    server = llamacpp_servers(n_ctx=2048, interrupt_requests=False)
    chunks, done, clean = _overlapping_stream(server)
    assert done and clean
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# --- greedy determinism (the replay probe relies on it) ----------------------------------------------------
# Observed divergence rate on 0.3.36, tiny model, 2 shared cores: 0%. The tests below: 0 of 20
# sequential repeats, mixing cold (after an unrelated prompt), warm (the same prompt again: its KV
# cache is reused but for the last token) and partly warm (a shared prefix) evaluation; 0 of 40
# with two requests in flight. A longer one-off run (10 prompts, 64 tokens, --n_ctx 512): 0 of 200
# sequential, 0 of 200 with 2 and 0 of 200 with 4 in flight. The server runs one request at a time
# behind a lock, so concurrent requests are never batched together. Real models may still diverge
# between cold and warm evaluation (a whole-prompt batch against one token), which this tiny F32
# model does not show.

REPLAY_PROMPT = "repeat exactly: the tenant canary 5f3a9c is a secret"


def test_greedy_output_is_identical_over_repeated_runs(client: httpx.Client) -> None:
    reference = text_of(complete(client, REPLAY_PROMPT, max_tokens=32))
    outputs = []
    for i in range(RUNS):
        if i % 3 == 1:
            complete(client, "an unrelated prompt", max_tokens=1)  # cold: nothing to reuse
        elif i % 3 == 2:
            complete(client, REPLAY_PROMPT[:20] + " other tail", max_tokens=1)  # a shared prefix
        outputs.append(text_of(complete(client, REPLAY_PROMPT, max_tokens=32)))
    diverged = sum(out != reference for out in outputs)
    assert diverged == 0, f"{diverged}/{RUNS} greedy runs diverged"


def test_greedy_output_is_identical_with_two_requests_in_flight(llamacpp_server: LlamaCppServer) -> None:
    prompts = [REPLAY_PROMPT, "the model server answer"]
    with httpx.Client(base_url=llamacpp_server.url, timeout=30.0) as c:
        reference = {p: text_of(complete(c, p, max_tokens=32)) for p in prompts}

    def run(prompt: str) -> tuple[str, str]:
        with httpx.Client(base_url=llamacpp_server.url, timeout=30.0) as c:
            return prompt, text_of(complete(c, prompt, max_tokens=32))

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, [prompts[i % 2] for i in range(2 * RUNS)]))
    diverged = sum(text != reference[prompt] for prompt, text in results)
    assert diverged == 0, f"{diverged}/{2 * RUNS} greedy runs with two in flight diverged"
