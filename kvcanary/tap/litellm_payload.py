"""LiteLLM's logging payload (``standard_logging_object``) read into an :class:`Exchange`.

Apart from :mod:`kvcanary.tap.litellm` (which needs LiteLLM itself) so that it can be tested
anywhere: the shapes are LiteLLM 1.110.2's (``id``, ``api_base``, ``model``, ``model_group``,
``stream``, ``prompt_tokens``, ``completion_tokens``, ``startTime``/``endTime``/``completionStartTime``
as epoch floats, ``messages``, ``response`` assembled for streams too, ``end_user``, and
``metadata.user_api_key_*``).

The payload's ``id`` (the engine's response id, as LiteLLM reports it) becomes the exchange's
``request_id`` and the record's ``upstream_id``: data, never the record's identity, which the tap
makes per exchange (``record.record_id``). Neither ``id`` nor ``litellm_call_id`` can be that: an
engine may give every response one id, and LiteLLM takes ``litellm_call_id`` from a client's
``x-litellm-call-id`` header when one is sent (``resolve_litellm_call_id``).

When LiteLLM redacts messages (``turn_off_message_logging``, or a caller's redaction), the payload
holds ``redacted-by-litellm`` in their place: such a text is no one's, so it is sent as none (no
size of 19 characters for a prompt of any length, no prints), and the exchange says it was
redacted (``extra["redacted"]``) for the tap to warn about.

The hook runs on the proxy's event loop, so reading a payload does no work in proportion to its
texts: the messages' and choices' texts are passed as parts (``Exchange.prompt_parts``,
``response_parts``), never joined here; the tap's thread joins what it fingerprints. Which texts of
a message, a choice or a Responses API item are read is the protocol's (``bodies.py``), as for
any gateway.
"""

from __future__ import annotations

from typing import Any

from kvcanary.tap.bodies import answer_facts, answer_texts, item_texts
from kvcanary.tap.fingerprints import joined_length
from kvcanary.tap.record import Exchange

#: What LiteLLM puts in place of a redacted text (``litellm.constants.REDACTED_BY_LITELLM``).
REDACTED = "redacted-by-litellm"


def prompt_of(messages: Any) -> tuple[tuple[str, ...], int]:
    """Return the prompt's text as parts (each message's texts by the protocol's rules,
    ``bodies.item_texts``: the text is the parts joined by newlines) and its message count; a
    string (a completion's prompt) is one message."""
    if isinstance(messages, str):
        return ((messages,) if messages else ()), 1
    if not isinstance(messages, list):
        return (), 0
    return tuple(t for m in messages for t in item_texts(m)), len(messages)


def response_of(response: Any) -> tuple[tuple[str, ...], str | None, int | None]:
    """Return the answer's text as parts (``bodies.answer_texts``: each choice's, or each Responses
    API output item's), its finish reason and its cached prompt tokens. A choice LiteLLM assembled
    from a stream may hold its message as ``delta``: read as its ``message``."""
    if not isinstance(response, dict):
        return (), None, None
    choices = response.get("choices")
    if isinstance(choices, list):
        choices = [
            {**c, "message": c["delta"]} if _delta_only(c) else c for c in choices
        ]  # fmt: skip
        response = {**response, "choices": choices}
    _, finish, (_, _, cached) = answer_facts(response)
    return tuple(answer_texts(response)), finish, cached


def _delta_only(choice: Any) -> bool:
    return isinstance(choice, dict) and "message" not in choice and isinstance(choice.get("delta"), dict)


def _redacted(parts: tuple[str, ...]) -> bool:
    """Whether the text the parts make is LiteLLM's placeholder (looked at only when short)."""
    return joined_length(parts) <= 4 * len(REDACTED) and "\n".join(parts).strip() == REDACTED


def caller_of(metadata: dict[str, Any], end_user: Any) -> tuple[str, str]:
    """Return (caller, kind): the team, else the key's alias, else its hash, else the end user."""
    for key, kind in (
        ("user_api_key_team_id", "team"),
        ("user_api_key_alias", "key_alias"),
        ("user_api_key_hash", "key_hash"),
    ):
        if metadata.get(key):
            return str(metadata[key]), kind
    if end_user or metadata.get("user_api_key_end_user_id"):
        return str(end_user or metadata["user_api_key_end_user_id"]), "end_user"
    return "", "unknown"


def exchange_of(payload: dict[str, Any], status: int) -> Exchange:
    """Return the exchange a ``standard_logging_object`` describes."""
    metadata = payload.get("metadata") or {}
    caller, kind = caller_of(metadata, payload.get("end_user"))
    prompt, messages = prompt_of(payload.get("messages"))
    response, finish, cached = response_of(payload.get("response"))
    redacted = _redacted(prompt) or _redacted(response)
    prompt, response = (() if _redacted(t) else t for t in (prompt, response))
    start, end = payload.get("startTime"), payload.get("endTime")
    first = payload.get("completionStartTime")
    number = (int, float)
    return Exchange(
        request_id=str(payload.get("id") or ""),
        started=float(start) if isinstance(start, number) else 0.0,
        caller=caller,
        caller_kind=kind,
        key_hash=str(metadata.get("user_api_key_hash") or ""),
        api_base=str(payload.get("api_base") or ""),
        model=str(payload.get("model") or ""),
        model_group=str(payload.get("model_group") or ""),
        stream=bool(payload.get("stream")),
        status=status,
        finish_reason=finish,
        latency_seconds=end - start if isinstance(start, number) and isinstance(end, number) else None,
        ttft_seconds=first - start if isinstance(start, number) and isinstance(first, number) else None,
        prompt_parts=prompt,
        messages=messages,
        response_parts=response,
        prompt_tokens=payload.get("prompt_tokens"),
        completion_tokens=payload.get("completion_tokens"),
        cached_tokens=cached,
        extra={"redacted": True} if redacted else {},
    )
