"""Bad input gets a 4xx in OpenAI's error shape naming the problem, and the worker keeps serving."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.workers.support import MODEL, complete

GOOD = {"model": MODEL, "prompt": "ok"}


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
        ("/v1/completions", {"prompt": "hi"}, 400, "'model'"),
        ("/v1/completions", {"model": MODEL}, 400, "'prompt'"),
        ("/v1/completions", {**GOOD, "prompt": ""}, 400, "'prompt'"),
        ("/v1/completions", {**GOOD, "prompt": 42}, 400, "'prompt'"),
        ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "'max_tokens'"),
        ("/v1/completions", {**GOOD, "max_tokens": -5}, 400, "'max_tokens'"),
        ("/v1/completions", {**GOOD, "max_tokens": "16"}, 400, "'max_tokens'"),
        ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "'stream'"),
        ("/v1/completions", {**GOOD, "temperature": -1}, 400, "'temperature'"),
        (
            "/v1/completions",
            {**GOOD, "stream_options": {"include_usage": "y"}},
            400,
            "stream_options.include_usage",
        ),
        ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "'messages'"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "'messages.0.role'"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": ""}]},
            400,
            "empty",
        ),
        ("/v1/completions", {**GOOD, "cache_salt": ""}, 400, "'cache_salt' must be a non-empty string"),
        ("/v1/completions", {**GOOD, "cache_salt": 7}, 400, "'cache_salt' must be a non-empty string"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "cache_salt": ["s"]},
            400,
            "'cache_salt' must be a non-empty string",
        ),
        ("/tokenize", {}, 400, "exactly one of"),
        ("/v1/nowhere", {}, 404, "Not Found"),
    ],
)
def test_it_refuses_bad_input_clearly_and_keeps_serving(
    serve: Callable[..., TestClient], path: str, body: Any, status: int, needle: str
) -> None:
    client = serve()
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"]
    assert set(error) >= {"message", "type", "code"}
    assert complete(client, "still here", max_tokens=20).json()["choices"][0]["text"] == "still here"


def test_it_names_the_unknown_model_code(serve: Callable[..., TestClient]) -> None:
    error = complete(serve(), "hi", model="nope").json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")


def test_it_rejects_an_over_capacity_prompt_in_aggregated_mode_with_sglang_wording(
    serve: Callable[..., TestClient],
) -> None:
    response = complete(serve(mode="aggregated"), "z" * 1500)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == "Input length (1500 tokens) exceeds the maximum allowed length (1023 tokens)."
    assert (error["type"], error["code"]) == ("BadRequestError", 400)


def test_it_rejects_a_prompt_over_the_context_window(serve: Callable[..., TestClient]) -> None:
    response = complete(serve(kv_pool_tokens=16384), "z" * 9000)
    assert response.status_code == 400
    assert "longer than the model's context length (8192 tokens)" in response.json()["error"]["message"]


def test_it_maps_api_keys_to_tenants_and_refuses_wrong_keys(serve: Callable[..., TestClient]) -> None:
    client = serve(api_keys={"sk-alice": "alice"})
    assert complete(client, "hi", key="sk-alice").status_code == 200
    for key in ("sk-wrong", None):
        response = complete(client, "hi", key=key)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert "sk-wrong" not in response.text
    assert client.get("/v1/models").status_code == 401
    assert client.get("/health").status_code == 200


def test_it_accepts_anyone_when_no_keys_are_configured(serve: Callable[..., TestClient]) -> None:
    client = serve()
    assert complete(client, "hi", key="whoever").status_code == 200
    assert complete(client, "hi").status_code == 200


def test_it_refuses_an_empty_cache_salt_with_vllm_wording(serve: Callable[..., TestClient]) -> None:
    error = complete(serve(prefix_cache="shared"), "hi", cache_salt="").json()["error"]
    assert error == {
        "message": "Parameter 'cache_salt' must be a non-empty string if provided.",
        "type": "invalid_request_error",
        "code": 400,
        "param": "cache_salt",
    }
