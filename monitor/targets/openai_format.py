"""The OpenAI-compatible wire format as the engines really speak it: request bodies, SSE, error bodies.

Kept apart from the HTTP client so that every shape an engine can send (see ``docs/engines.md``) is
parsed in one place. Nothing here does I/O except :func:`read_bounded`; nothing here raises on a
bad answer: :class:`StreamState` records ``protocol`` or ``stream`` failures instead.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvcanary.probes.target import Completion, CompletionRequest
from kvcanary.probes.untrusted import plain

#: How much of an error body is kept: enough for any engine's message, not a second copy of a prompt.
ERROR_BODY_BYTES = 4096


@dataclass(frozen=True)
class Limits:
    """The most the monitor reads of anything a target sends: exceeding one is an ``error`` verdict.

    A probe's answer is at most a few thousand tokens; streamed, each token costs one SSE event of a
    few hundred bytes: 8,192 tokens make about 2.5 MB. A lookup (server info, a /metrics page) is
    ~100 KB on vLLM.
    """

    response_bytes: int = 4 * 1024 * 1024
    sse_line_bytes: int = 256 * 1024
    lookup_bytes: int = 8 * 1024 * 1024


DEFAULT_LIMITS = Limits()


class ResponseTooLarge(Exception):
    """A target sent more than a limit allows; ``str()`` says which."""


async def sse_lines(body: AsyncIterator[bytes], limits: Limits) -> AsyncIterator[str]:
    """Yield the lines of an event stream, enforcing the line and the total byte limits while reading."""
    pending = b""
    total = 0
    async for chunk in body:
        total += len(chunk)
        if total > limits.response_bytes:
            raise ResponseTooLarge(f"the stream is over {limits.response_bytes} bytes")
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
        if len(pending) > limits.sse_line_bytes:
            raise ResponseTooLarge(f"a stream line is over {limits.sse_line_bytes} bytes")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", "replace")


_MESSAGE_CHARS = 500
#: Choices of one body read at most (``n`` asks for several; more than this is no engine's answer).
MAX_CHOICES = 16


def request_body(
    request: CompletionRequest, model: str, *, takes_rid: bool = False
) -> tuple[str, dict[str, Any]]:
    """Return ``(path, json_body)`` for ``request``: chat messages or a raw prompt. ``takes_rid``:
    the engine accepts SGLang's ``rid`` field (others may refuse a field they do not know)."""
    body: dict[str, Any] = {"model": request.model or model}
    if request.chat:
        path = "/v1/chat/completions"
        messages = [{"role": "system", "content": request.system}] if request.system else []
        messages += [{"role": role, "content": content} for role, content in request.history]
        body["messages"] = [*messages, {"role": "user", "content": request.prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = "\n".join([*(content for _, content in request.history), request.prompt])
    body.update(max_tokens=request.max_tokens, temperature=request.temperature, stream=request.stream)
    if request.seed is not None:
        body["seed"] = request.seed
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    if request.request_id is not None:
        body["user"] = request.request_id
        if takes_rid:
            body["rid"] = request.request_id
    body.update(request.extra)
    if request.stream:
        # Without this no engine sends usage in a stream, and prompt_tokens is the incident's tell.
        body["stream_options"] = {"include_usage": True}
    return path, body


def error_message(raw: str) -> str | None:
    """Return the message of an engine's error body, or None when the body is not a known shape.

    Shapes: vLLM/OpenAI ``{"error": {"message", "type", "code"}}``, SGLang ``{"object": "error",
    "message", ...}``, llama.cpp ``{"error": {"code", "type", "message", "n_prompt_tokens", "n_ctx"}}``,
    FastAPI ``{"detail": ...}``.
    """
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    message: Any = None
    if isinstance(err, dict):
        message = err.get("message") or _describe_llamacpp(err)
    elif isinstance(err, str):
        message = err
    if not message:
        message = data.get("message") or data.get("detail")
    if isinstance(message, list | dict):
        message = json.dumps(message)
    # The engine's words: shown in results, titles and logs, so made plain (probes/untrusted.py).
    return plain(message, _MESSAGE_CHARS) if message else None


def _describe_llamacpp(err: dict[str, Any]) -> str | None:
    # Older llama.cpp builds send only type and counts; say them in words.
    kind = err.get("type")
    if not isinstance(kind, str):
        return None
    n_prompt, n_ctx = err.get("n_prompt_tokens"), err.get("n_ctx")
    if n_prompt is not None and n_ctx is not None:
        return f"{kind}: request ({n_prompt} tokens) exceeds the context size ({n_ctx} tokens)"
    return kind


async def read_bounded(body: AsyncIterator[bytes], limit: int) -> str:
    """Return at most ``limit`` bytes of the body, decoded leniently (an error body may be anything)."""
    buf = bytearray()
    async for chunk in body:
        buf += chunk
        if len(buf) >= limit:
            break
    return bytes(buf[:limit]).decode("utf-8", "replace")


async def read_limited(
    body: AsyncIterator[bytes], limit: int, declared: int | None = None
) -> tuple[str, bool]:
    """Return the body decoded leniently and whether it was complete; stop reading past ``limit`` bytes.

    A declared length (``Content-Length``) over the limit is refused before a byte is read.
    """
    if declared is not None and declared > limit:
        return "", False
    buf = bytearray()
    async for chunk in body:
        buf += chunk
        if len(buf) > limit:
            return "", False
    return bytes(buf).decode("utf-8", "replace"), True


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class StreamState:
    """What is known of one answer so far; :meth:`to_completion` turns it into a Completion."""

    chat: bool
    started: float
    status: int | None = None
    parts: list[str] = field(default_factory=list)
    #: What reasoning fields carried, kept apart from ``parts``: interleaved delta by delta, the two
    #: streams would cut a marker that one of them sends in pieces.
    reasoning: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    first_token_at: float | None = None
    error: str | None = None
    error_kind: str | None = None
    chunks: int = 0
    done: bool = False

    @property
    def text(self) -> str:
        """What the tenant was sent: the reasoning (when there is any), then the answer."""
        if self.reasoning:
            return "".join(self.reasoning) + "\n" + "".join(self.parts)
        return "".join(self.parts)

    @text.setter
    def text(self, value: str) -> None:
        self.parts, self.reasoning = [value], []

    def fail(self, kind: str, message: str) -> None:
        """Record a failure; the first one is the cause, later ones are consequences."""
        if self.error_kind is None:
            self.error_kind, self.error = kind, message

    def feed_sse_line(self, line: str, now: float) -> bool:
        """Take one line of an event stream; return False when the stream is over or broken."""
        line = line.strip()
        if not line.startswith("data:"):
            return True  # blank separators, ": keep-alive" comments, event:/id: fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return False
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.parts.append("\n" + payload)  # still output a tenant saw: scanned like the rest
            self.fail("protocol", "a stream chunk is not JSON")
            return False
        if not isinstance(chunk, dict):
            self.parts.append("\n" + payload)
            self.fail("protocol", "a stream chunk is not a JSON object")
            return False
        self.chunks += 1
        if "error" in chunk or chunk.get("object") == "error":
            # SGLang and vLLM report errors raised after the headers inside the stream, with status 200.
            self.parts.append(payload[:ERROR_BODY_BYTES])
            self.fail("stream", error_message(payload) or "the engine reported an error in the stream")
            return False
        return self._absorb(chunk, now, "delta")

    def keep_tail(self, line: str) -> None:
        """Keep what a broken stream sent after the break (within the stream's byte limit): it
        reached the tenant all the same, so it is scanned for markers like the rest."""
        if self.error_kind is not None and line.strip():
            self.parts.append("\n" + line)

    def finish_stream(self) -> None:
        """Judge how the stream ended: a cut stream is a protocol failure, not a short answer."""
        if self.error_kind is not None or self.done:
            return
        if self.chunks == 0:
            self.fail("protocol", "the stream ended without any data")
        elif self.finish_reason is None:
            self.fail("protocol", "the stream ended before [DONE] or a finish_reason")

    def apply_error_body(self, raw: str) -> None:
        """Keep the prompt length llama.cpp states in its refusal (``n_prompt_tokens``)."""
        try:
            data = json.loads(raw)
        except ValueError:
            return
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict):
            self.prompt_tokens = _int(err.get("n_prompt_tokens"))

    def _absorb(self, chunk: dict[str, Any], now: float, key: str) -> bool:
        choices = chunk.get("choices")
        if choices is not None and not isinstance(choices, list):
            self.fail("protocol", "choices is not a list")
            return False
        # A stream's chunk carries one choice; a whole body may carry several (``n``), and every one
        # is output a tenant sees: all are kept (one per line), so all are scanned.
        for index, choice in enumerate((choices or [])[: 1 if key == "delta" else MAX_CHOICES]):
            if not isinstance(choice, dict):
                self.fail("protocol", "a choice is not an object")
                return False
            thought, piece = _choice_text(choice, self.chat, key)
            if thought:
                self.reasoning.append(thought)
            if piece:
                self.parts.append(f"\n{piece}" if index else piece)
                # Time to first token means something only for a stream.
                if self.first_token_at is None and key == "delta":
                    self.first_token_at = now
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and index == 0:
                self.finish_reason = reason
        self._absorb_usage(chunk.get("usage"))
        return True

    def _absorb_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        self.prompt_tokens = _int(usage.get("prompt_tokens"))
        self.completion_tokens = _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            self.cached_tokens = _int(details.get("cached_tokens"))

    def to_completion(self, now: float) -> Completion:
        ttft = self.first_token_at - self.started if self.first_token_at is not None else None
        return Completion(
            status=self.status,
            text=self.text,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            finish_reason=self.finish_reason,
            latency_seconds=now - self.started,
            ttft_seconds=ttft,
            error=self.error,
            error_kind=self.error_kind,
        )


def _choice_text(choice: dict[str, Any], chat: bool, key: str) -> tuple[str, str]:
    """Return (reasoning, content) of one choice. Reasoning models put part of what a tenant sees in
    ``reasoning_content`` or ``reasoning``; some engines send the same text in both (vLLM while it
    renamed the field), which must count once."""
    holder = choice.get(key) if chat else None
    if not isinstance(holder, dict):
        text = choice.get("text")
        return "", text if isinstance(text, str) else ""
    named = [holder.get("reasoning_content"), holder.get("reasoning")]
    thoughts = list(dict.fromkeys(t for t in named if isinstance(t, str) and t))
    content = holder.get("content")
    return "".join(thoughts), content if isinstance(content, str) else ""


def parse_body(raw: bytes, state: StreamState, now: float) -> None:
    """Fill ``state`` from a non-streamed JSON answer; a body that is not one is a protocol failure."""
    text = raw.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        state.text = text[:ERROR_BODY_BYTES]
        state.fail("protocol", "the body is not JSON")
        return
    if not isinstance(data, dict):
        state.fail("protocol", "the body is not a JSON object")
        return
    if "error" in data or data.get("object") == "error":
        state.text = text[:ERROR_BODY_BYTES]
        state.fail("stream", error_message(text) or "the engine reported an error with status 200")
        return
    if not isinstance(data.get("choices"), list) or not data["choices"]:
        state.fail("protocol", "the body has no choices")
        return
    state.chunks = 1
    state._absorb(data, now, "message")
    state.done = True


def take_error(state: StreamState, status: int, raw: str) -> None:
    """Keep a non-2xx answer: its body is output a tenant sees; an engine's error or another's."""
    state.status = status
    state.text = raw
    state.apply_error_body(raw)
    message = error_message(raw)
    if message is None:  # no engine wrote this body: a proxy, a load balancer, a redirect
        state.fail("foreign", f"HTTP {status} with a body that is no engine's error")
    else:
        state.fail("http", message)
