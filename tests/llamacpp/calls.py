"""Requests to the llama-cpp-python test server, and the tiny model's token facts, for its tests."""

from __future__ import annotations

import re
from typing import Any

import httpx

# make_tiny_gguf.py's vocabulary: 0 <unk>, 1 <s>, 2 </s>, then <0x00>..<0xFF> from id 3.
BOS, EOS = 1, 2
FIRST_BYTE_TOKEN = 3
CONTEXT_MESSAGE = re.compile(r"maximum context length is (\d+) tokens")


def complete(client: httpx.Client, prompt: Any, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    return client.post("/v1/completions", json=body)


def chat(client: httpx.Client, content: str, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}
    return client.post("/v1/chat/completions", json={"temperature": 0, **body})


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def count_tokens(client: httpx.Client, text: str) -> int:
    return int(client.post("/extras/tokenize/count", json={"input": text}).json()["count"])


def stream_lines(client: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    """Return the ``data:`` payloads of a streamed request, in order."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
