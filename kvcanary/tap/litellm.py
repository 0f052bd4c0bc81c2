"""The tap as a LiteLLM proxy callback.

In the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: kvcanary.tap.litellm.tap

LiteLLM calls :meth:`KVCanaryTap.async_log_success_event` (and the failure twin) after the
response has gone to the client, with ``kwargs["standard_logging_object"]``: the request's id,
deployment, caller and usage, the messages and the assembled response (streams included). The
hook turns it into an :class:`~kvcanary.tap.record.Exchange` and queues it; summarizing and
sending happen on the tap's own thread. Configured from the environment (``kvcanary.tap``).

If the proxy cannot import an installed module by that path, put a file ``kvcanary_tap.py``
beside the config holding ``from kvcanary.tap.litellm import tap`` and name
``kvcanary_tap.tap`` instead (LiteLLM resolves callback paths from the config's folder).
"""

from __future__ import annotations

import logging
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from kvcanary.tap import Exchange, Tap

log = logging.getLogger("kvcanary.tap")


def _text(content: Any) -> str:
    """Return the text of a message's content: a string, or a list of parts with ``text``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def prompt_of(messages: Any) -> tuple[str, int]:
    """Return the prompt's text (every message's content, one per line) and its message count."""
    if isinstance(messages, str):
        return messages, 1
    if not isinstance(messages, list):
        return "", 0
    return "\n".join(_text(m.get("content")) for m in messages if isinstance(m, dict)), len(messages)


def response_of(response: Any) -> tuple[str, str | None, int | None]:
    """Return the answer's text (every choice), its finish reason and its cached prompt tokens."""
    if not isinstance(response, dict):
        return "", None, None
    texts, finish = [], None
    for choice in response.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message") or choice.get("delta") or {}
        texts.append(_text(message.get("content")) if isinstance(message, dict) else "")
        if isinstance(choice.get("text"), str):
            texts.append(choice["text"])
        finish = finish or choice.get("finish_reason")
    usage = response.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {} if isinstance(usage, dict) else {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return "\n".join(t for t in texts if t), finish, cached


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
        prompt=prompt,
        messages=messages,
        response=response,
        prompt_tokens=payload.get("prompt_tokens"),
        completion_tokens=payload.get("completion_tokens"),
        cached_tokens=cached,
    )


def _failure_status(kwargs: dict[str, Any]) -> int:
    exc = kwargs.get("exception")
    code = getattr(exc, "status_code", None)
    return code if isinstance(code, int) else 500


class KVCanaryTap(CustomLogger):  # type: ignore[misc]  # LiteLLM ships no type hints here
    """LiteLLM's logging hooks → the tap."""

    def __init__(self, tap: Tap):
        super().__init__()
        self.tap = tap

    def _observe(self, kwargs: dict[str, Any], status: int) -> None:
        payload = kwargs.get("standard_logging_object")
        if not isinstance(payload, dict):
            return
        try:
            self.tap.observe(exchange_of(payload, status))
        except Exception:  # a tap never fails a request, nor LiteLLM's other callbacks
            log.exception("kvcanary tap: cannot read LiteLLM's logging payload")

    async def async_log_success_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._observe(kwargs, 200)

    async def async_log_failure_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._observe(kwargs, _failure_status(kwargs))


#: The instance ``litellm_settings.callbacks`` names, built when the proxy loads its config: a
#: missing or wrong variable stops the proxy there with a message naming it, not at a request.
tap = KVCanaryTap(Tap.from_env())
