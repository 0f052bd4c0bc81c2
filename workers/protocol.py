"""OpenAI request bodies (validated by pydantic) and the response and chunk shapes the worker sends.

Accepted and ignored: ``temperature``, ``seed``, ``top_p``, ``user`` and any other extra field; the
CopyModel is greedy and deterministic, so sampling settings cannot change its output. Honoured, as
vLLM honours them (``workers.sampling``): ``stop`` (strings that end the answer, never sent),
``allowed_token_ids`` (the only tokens the answer may hold: bytes, 0-255; one out of the vocabulary
is refused with HTTP 400, as vLLM refuses it) and ``thinking_token_budget`` (tokens before the
reasoning-end string is forced, with ``--reasoning-end-str``). ``max_tokens`` defaults to 16; chat
also accepts ``max_completion_tokens``, which wins.

``cache_salt`` (vLLM's field) limits prefix cache hits to requests sending the same salt; like vLLM
the worker refuses one that is empty or not a string (HTTP 400), and accepts it with the cache off.
``usage.prompt_tokens_details.cached_tokens`` is present exactly when the prefix cache is on.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from kvcanary.workers.model import VOCAB_SIZE
from kvcanary.workers.request import SamplingParams

DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    #: vLLM's extra sampling fields (``workers.sampling``).
    allowed_token_ids: list[int] | None = None
    thinking_token_budget: int | None = Field(default=None, ge=0)
    cache_salt: str | None = None
    #: SGLang's client request id; OpenAI's end-user id. Only the ``rid-collision`` bug reads them.
    rid: str | None = None
    user: str | None = None
    #: SGLang's model gateway adds these for a prefill and a decode server (``workers.pd_api``).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    #: The data-parallel rank that serves the request (SGLang's ``routed_dp_rank``; the deprecated
    #: ``data_parallel_rank`` is read where it is absent), and on a decode server the prefill rank
    #: that holds its K/V (``disagg_prefill_dp_rank``). Without one, ``workers.dp`` picks.
    routed_dp_rank: int | None = Field(default=None, ge=0)
    data_parallel_rank: int | None = Field(default=None, ge=0)
    disagg_prefill_dp_rank: int | None = Field(default=None, ge=0)

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _cache_salt_is_a_non_empty_string(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, str) or not value):
            # vLLM's wording; the "parameter" error type makes the handler send the message as it is.
            raise PydanticCustomError(
                "parameter", "Parameter 'cache_salt' must be a non-empty string if provided"
            )
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_ids_in_the_vocabulary(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(not 0 <= i < VOCAB_SIZE for i in value)):
            raise PydanticCustomError(
                "parameter",
                f"allowed_token_ids must be a non-empty list of token ids below {VOCAB_SIZE}",
            )
        return value

    def sampling(self) -> SamplingParams:
        """Return the sampling parameters the engine honours (empty stop strings are dropped)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            stop=tuple(dict.fromkeys(s.encode() for s in stop if s)),
            allowed=frozenset(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            thinking_budget=self.thinking_token_budget,
        )

    @property
    def include_usage(self) -> bool:
        """Return True when a streamed response must end with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def token_budget(self) -> int:
        """Return the requested maximum of new tokens."""
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS


class CompletionRequest(GenerationRequest):
    """Body of ``POST /v1/completions``; ``prompt`` is one non-empty string."""

    prompt: str = Field(min_length=1)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """Return the message's text (parts concatenated; no content is an empty string)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """Body of ``POST /v1/chat/completions``; ``messages`` holds at least one message."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)

    def token_budget(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().token_budget()


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``: exactly one of ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


@dataclass(frozen=True)
class Usage:
    """OpenAI's usage; ``cached_tokens`` None (prefix cache off) leaves out ``prompt_tokens_details``."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return body


class ResponseShape:
    """Build the JSON bodies of one response, plain or streamed, for ``completion`` or ``chat``."""

    def __init__(self, kind: Literal["completion", "chat"], model: str) -> None:
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def complete(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """Return the non-streamed response body."""
        if self.kind == "chat":
            body = self._envelope("chat.completion")
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            body = self._envelope("text_completion")
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason)
        body.update(choices=[choice], usage=usage.body())
        return body

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        with_usage: bool = False,
    ) -> dict[str, Any]:
        """Return one streamed chunk carrying ``text`` (chat: as a delta; the first one names the role)."""
        if self.kind == "chat":
            body = self._envelope("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            body = self._envelope("text_completion")
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        body["choices"] = [choice]
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """Return the final ``stream_options.include_usage`` chunk: no choices, the usage."""
        object_name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(object_name)
        body.update(choices=[], usage=usage.body())
        return body
