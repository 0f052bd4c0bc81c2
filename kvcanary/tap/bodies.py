"""The texts of an exchange as an OpenAI-compatible gateway sees it: which text of each request
and response shape the tap reads (``docs/tap-protocol.md``, "What is read"), the same for every
tap in every language, so that two taps print one exchange alike.

A request's texts, in order (empty strings left out):

- chat completions (``messages``): each message's texts (:func:`item_texts`);
- the Responses API (``instructions``, ``input``): ``instructions``, then ``input`` (a string, or
  each item's texts);
- completions (``prompt``): the prompt (a string, or each string of a list; token ids are no
  text), then ``suffix``.

A response's texts: each choice's (in their order) ``message`` texts and ``text``; or, from the
Responses API, each ``output`` item's. A stream is assembled first (:func:`assembled`) into the
response it stands for. An item's (or message's) texts are its reasoning (``reasoning_content``,
or where that is absent ``reasoning``), its ``content`` (a string, or each part's ``text``, a
refusal part's ``refusal``), its ``refusal``, each tool call's ``function.arguments`` and a
``function_call``'s ``arguments``; a Responses ``function_call`` item's ``arguments``, a
``function_call_output`` item's ``output``, a ``reasoning`` item's ``content`` then ``summary``
parts. Roles, names, images, audio and files are no text. The prompt is its texts joined by
newlines, and so is the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcanary.tap.record import Exchange

#: Events of a Responses API stream that carry the whole response at their end.
_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def _strings(*values: Any) -> list[str]:
    return [v for v in values if isinstance(v, str) and v]


def content_texts(content: Any) -> list[str]:
    """Return the texts of a ``content`` (or an ``output``): a string, or a list of parts, each
    its ``text`` or, a part of type ``refusal``, its ``refusal``."""
    if isinstance(content, str):
        return _strings(content)
    if not isinstance(content, list):
        return []
    found: list[str] = []
    for part in content:
        if isinstance(part, dict):
            text = part.get("text")
            found += _strings(
                text
                if isinstance(text, str)
                else part.get("refusal")
                if part.get("type") == "refusal"
                else None
            )
    return found


def item_texts(item: Any) -> list[str]:
    """Return the texts of a chat message, or of a Responses API input or output item."""
    if not isinstance(item, dict):
        return []
    kind = item.get("type")
    if kind == "function_call":
        return _strings(item.get("arguments"))
    if kind == "function_call_output":
        return content_texts(item.get("output"))
    if kind == "reasoning":
        return content_texts(item.get("content")) + content_texts(item.get("summary"))
    if kind not in (None, "message"):
        return []
    reasoning = item.get("reasoning_content")
    texts = _strings(reasoning if isinstance(reasoning, str) and reasoning else item.get("reasoning"))
    texts += content_texts(item.get("content")) + _strings(item.get("refusal"))
    for call in item.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        texts += _strings(function.get("arguments")) if isinstance(function, dict) else []
    call = item.get("function_call")
    return texts + (_strings(call.get("arguments")) if isinstance(call, dict) else [])


def prompt_texts(request: Any) -> tuple[list[str], int]:
    """Return a request body's texts and its message count (the module doc): chat messages, the
    Responses API's ``instructions`` (one) and ``input`` items (a string is one), completions'
    prompts (a string is one; a list whose first item is a string or a list is as many as it
    holds, its strings the texts; any other list is one prompt of token ids, no text)."""
    if not isinstance(request, dict):
        return [], 0
    messages = request.get("messages")
    if isinstance(messages, list):
        return [t for m in messages for t in item_texts(m)], len(messages)
    if "input" in request or "instructions" in request:
        given = request.get("input")
        instructions = _strings(request.get("instructions"))
        if isinstance(given, list):
            return instructions + [t for i in given for t in item_texts(i)], len(given) + len(instructions)
        return instructions + _strings(given), int(isinstance(given, str)) + len(instructions)
    prompt = request.get("prompt")
    suffix = _strings(request.get("suffix"))
    if isinstance(prompt, str):
        return _strings(prompt) + suffix, 1
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], str | list):  # prompts, as texts or as lists of token ids
            return _strings(*prompt) + suffix, len(prompt)
        return suffix, 1  # one prompt of token ids
    return suffix, 0


def answer_texts(response: Any) -> list[str]:
    """Return a response body's texts: each choice's ``message`` texts then its ``text``, or each
    Responses API ``output`` item's."""
    if not isinstance(response, dict):
        return []
    texts: list[str] = []
    if isinstance(response.get("choices"), list):
        for choice in response["choices"]:
            if isinstance(choice, dict):
                texts += item_texts(choice.get("message")) + _strings(choice.get("text"))
    elif isinstance(response.get("output"), list):
        texts = [t for item in response["output"] for t in item_texts(item)]
    return texts


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def answer_facts(response: Any) -> tuple[str, str | None, tuple[int | None, int | None, int | None]]:
    """Return a response body's id, finish reason (the first choice's that says one; a Responses
    API response's ``status``) and usage (prompt, completion and cached prompt tokens)."""
    if not isinstance(response, dict):
        return "", None, (None, None, None)
    given = response.get("usage")
    usage: dict[str, Any] = given if isinstance(given, dict) else {}
    upstream = response["id"] if isinstance(response.get("id"), str) else ""
    if isinstance(response.get("output"), list) or ("status" in response and "choices" not in response):
        details = usage.get("input_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        status = response.get("status")
        tokens = (_count(usage.get("input_tokens")), _count(usage.get("output_tokens")), cached)
        return upstream, status if isinstance(status, str) else None, tokens
    finish = next(
        (
            c["finish_reason"]
            for c in response.get("choices") or []
            if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)
        ),
        None,
    )  # fmt: skip
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return (
        upstream,
        finish,
        (_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), cached),
    )


def assembled(events: Sequence[Any]) -> dict[str, Any]:
    """Return the response a stream stands for: chat or completions chunks joined by choice
    (:func:`_joined_chunks`), or a Responses API stream's (:func:`_joined_events`)."""
    typed = [e for e in events if isinstance(e, dict)]
    if any(str(e.get("type", "")).startswith("response.") for e in typed):
        return _joined_events(typed)
    return _joined_chunks(typed)


def _joined_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Chunks joined: per choice ``index`` (ascending), each delta's reasoning, content, refusal and
    tool calls' arguments (by the call's ``index``) appended, and ``text``; the first chunk's id,
    the last finish reason a choice gave, the last ``usage`` given."""
    choices: dict[int, dict[str, Any]] = {}
    answer: dict[str, Any] = {"id": "", "choices": [], "usage": None}
    for chunk in chunks:
        if not answer["id"] and isinstance(chunk.get("id"), str):
            answer["id"] = chunk["id"]
        if isinstance(chunk.get("usage"), dict):
            answer["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = _count(choice.get("index")) or 0
            joined = choices.setdefault(
                index, {"message": {"tool_calls": {}}, "text": "", "finish_reason": None}
            )
            message, delta = joined["message"], choice.get("delta")
            if isinstance(delta, dict):
                for key in ("reasoning_content", "reasoning", "content", "refusal"):
                    if isinstance(delta.get(key), str):
                        message[key] = message.get(key, "") + delta[key]
                for position, call in enumerate(delta.get("tool_calls") or []):
                    function = call.get("function") if isinstance(call, dict) else None
                    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                        at = _count(call.get("index"))
                        calls = message["tool_calls"]
                        calls[position if at is None else at] = (
                            calls.get(position if at is None else at, "") + function["arguments"]
                        )
                legacy = delta.get("function_call")
                if isinstance(legacy, dict) and isinstance(legacy.get("arguments"), str):
                    message["function_call"] = {
                        "arguments": message.get("function_call", {}).get("arguments", "")
                        + legacy["arguments"]
                    }
            if isinstance(choice.get("text"), str):
                joined["text"] += choice["text"]
            if isinstance(choice.get("finish_reason"), str):
                joined["finish_reason"] = choice["finish_reason"]
    for index in sorted(choices):
        joined = choices[index]
        calls = joined["message"].pop("tool_calls")
        joined["message"]["tool_calls"] = [{"function": {"arguments": calls[i]}} for i in sorted(calls)]
        answer["choices"].append({"index": index, **joined})
    return answer  # fmt: skip


def _joined_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A Responses API stream's response: that of its last ``response.completed``,
    ``response.incomplete`` or ``response.failed`` event; else (a cut stream) the items of its
    ``response.output_item.done`` events by ``output_index``, and for an item with none, its
    ``*.delta`` events' text appended in arrival order, a part per content or summary index."""
    final = [
        e["response"]
        for e in events
        if e.get("type") in _FINAL_EVENTS and isinstance(e.get("response"), dict)
    ]
    if final:
        last: dict[str, Any] = final[-1]
        return last
    created: dict[str, Any] = next((e["response"] for e in events if isinstance(e.get("response"), dict)), {})
    done: dict[int, Any] = {}
    deltas: dict[int, dict[int, str]] = {}
    for event in events:
        index = _count(event.get("output_index"))
        if index is None:
            continue
        if event.get("type") == "response.output_item.done":
            done[index] = event.get("item")
        elif str(event.get("type", "")).endswith(".delta") and isinstance(event.get("delta"), str):
            part = _count(event.get("content_index")) or _count(event.get("summary_index")) or 0
            parts = deltas.setdefault(index, {})
            parts[part] = parts.get(part, "") + event["delta"]
    output = [
        done[i]
        if i in done
        else {"type": "message", "content": [{"text": deltas[i][p]} for p in sorted(deltas[i])]}
        for i in sorted(done.keys() | deltas.keys())
    ]
    return {"id": created.get("id", ""), "status": created.get("status"), "output": output}  # fmt: skip


def exchange_of_bodies(
    request: Any,
    response: Any = None,
    *,
    events: Sequence[Any] | None = None,
    started: float = 0.0,
    caller: str = "",
    caller_kind: str = "unknown",
    key: str = "",
    api_base: str = "",
    model_group: str = "",
    status: int = 200,
    latency_seconds: float | None = None,
    ttft_seconds: float | None = None,
) -> Exchange:
    """Return the exchange of a request body and its response body (or, streamed, its chunks or
    events): the texts by the module doc's rules, the model asked for, the response's id, finish
    reason and usage; the rest is what the gateway knows (who asked, with which key, which
    deployment answered, the status and the times)."""
    answer = assembled(events) if events is not None else response
    prompt, messages = prompt_texts(request)
    upstream, finish, (prompt_tokens, completion_tokens, cached) = answer_facts(answer)
    model = request.get("model") if isinstance(request, dict) else None
    return Exchange(
        request_id=upstream, started=started, caller=caller, caller_kind=caller_kind, api_base=api_base,
        model=model if isinstance(model, str) else "", model_group=model_group, key_hash=key,
        stream=events is not None, status=status, finish_reason=finish, latency_seconds=latency_seconds,
        ttft_seconds=ttft_seconds, prompt_parts=tuple(prompt), messages=messages,
        response_parts=tuple(answer_texts(answer)), prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, cached_tokens=cached,
    )  # fmt: skip
