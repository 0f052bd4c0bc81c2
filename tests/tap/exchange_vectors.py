"""The whole exchanges of the golden vectors (``tests/fixtures/wire/exchanges.json``): for every
request and response shape the protocol reads (chat with content parts, tool calls and their
results, reasoning and refusals, several choices, completions, the Responses API, each streamed),
and for refused requests, public texts, a long prompt, markers and hostile names, what the gateway
knows, the request body, the response body (or the stream's chunks or events), and the record the
Python tap makes of them, as bytes.
"""

# ruff: noqa: E501, RUF001 - request and response bodies, one a line as a gateway sees them; hard cases
from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvcanary import wire
from kvcanary.tap.bodies import exchange_of_bodies
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.public import public_prints, tell
from kvcanary.tap.record import Refusal, summarize

#: The golden vectors' key: every print of every file is made under it.
KEY = b"kvcanary-golden-vector-key-0001!"
KEY_HEX = KEY.hex()
LICENCE = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software "
    "and associated documentation files, to deal in the Software without restriction, including "
    "without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense."
)
MARKER = "KVC-0123abcd-" + "0123456789abcdef" * 2
#: What the gateway knows, unless an exchange says otherwise; ``record_id`` fixes the tap's random id.
GATEWAY: dict[str, Any] = {
    "record_id": "tap-000000000000000000000001", "time": 1767225600.123456, "caller": "team-a",
    "caller_kind": "team", "key": "sk-1234567890abcdef", "api_base": "http://10.0.0.7:8000/v1",
    "model_group": "chat", "status": 200, "latency_seconds": 1.5, "ttft_seconds": 0.25,
}  # fmt: skip
SECRET = (
    "Our client Hendrikson Ltd owes 48213 euros on invoice INV_7731; wire it to account "
    "NL91ABNA0417164300 before Friday, and do not tell Marta Oyelaran about the discount."
)
REASONING = "The caller wants a summary; the note names Hendrikson Ltd and invoice INV_7731."
TOOL_ARGS = '{"query": "invoice INV_7731 Hendrikson", "limit": 5}'
USER = {"role": "user", "content": f"Summarize this note. {SECRET}"}


def _chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "llama-3-8b", "messages": list(messages), **fields}


def _answer(*choices: dict[str, Any], **fields: Any) -> dict[str, Any]:
    usage = {"prompt_tokens": 120, "completion_tokens": 40, "prompt_tokens_details": {"cached_tokens": 64}}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": list(choices),
        "usage": usage,
        **fields,
    }


def _said(content: Any, finish: str | None = "stop", index: int = 0, **message: Any) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": content, **message},
        "finish_reason": finish,
    }


def _chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    return {"id": "chatcmpl-s", "object": "chat.completion.chunk", "choices": [choice]}


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


# fmt: off
def chat_inputs() -> list[dict[str, Any]]:
    """Chat completions: strings, content parts, tool calls and results, reasoning, choices, a stream."""
    said = f"Hendrikson Ltd owes 48213 euros (INV_7731). {SECRET[:60]} {MARKER}"
    parts = [
        {"type": "text", "text": "Look at this receipt."},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": SECRET}, {"type": "input_audio", "input_audio": {"data": "AAAA"}},
    ]
    answer_parts = [
        {"type": "text", "text": "The receipt is for Hendrikson Ltd."},
        {"type": "refusal", "refusal": "I will not read the card number."},
    ]
    history = [
        USER, {"role": "assistant", "content": None, "tool_calls": [_call("search", TOOL_ARGS)]},
        {"role": "tool", "tool_call_id": "call_search", "content": "Found INV_7731 and INV_7740 of Hendrikson Ltd."},
        {"role": "assistant", "content": "", "function_call": {"name": "legacy", "arguments": '{"a": 1}'}},
        {"role": "user", "content": ""},
    ]
    calls = [_call("pay", '{"iban": "NL91ABNA0417164300"}'), _call("notify", '{"to": "Marta"}')]
    return [
        {"name": "chat_string", "request": _chat({"role": "system", "content": "Be brief."}, USER),
         "response": _answer(_said(said))},
        {"name": "chat_content_parts_and_images", "request": _chat({"role": "user", "content": parts}),
         "response": _answer(_said(answer_parts))},
        {"name": "chat_tool_calls_and_results", "request": _chat(*history),
         "response": _answer(_said(None, "tool_calls", tool_calls=calls))},
        {"name": "chat_reasoning_and_refusal", "request": _chat(USER),
         "response": _answer(_said("Done.", reasoning_content=REASONING, reasoning=REASONING, refusal=None))},
        {"name": "chat_several_choices", "request": _chat(USER, n=3),
         "response": _answer(_said("First: Hendrikson owes 48213."), _said("", None, 1),
                             _said("Third: INV_7731 is due.", "length", 2))},
        {"name": "chat_stream", "request": _chat(USER, stream=True, stream_options={"include_usage": True}),
         "events": [
             _chunk(0, {"role": "assistant", "content": ""}), _chunk(1, {"reasoning_content": "Think "}),
             _chunk(0, {"content": "Hendrikson "}), _chunk(1, {"reasoning_content": "twice."}),
             _chunk(0, {"content": "owes 48213."}, "stop"),
             _chunk(1, {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"x"'}}]}),
             _chunk(1, {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"),
             {"id": "chatcmpl-s", "choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 12}},
         ]},
    ]


def completion_inputs() -> list[dict[str, Any]]:
    """Completions: a prompt and its suffix, a list of prompts, token ids, a stream."""
    return [
        {"name": "completions_string",
         "request": {"model": "llama-3-8b", "prompt": f"Continue: {SECRET}", "suffix": "End of note."},
         "response": {"id": "cmpl-1", "choices": [{"index": 0, "text": " Marta was told.", "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 50, "completion_tokens": 16}}},
        {"name": "completions_list", "request": {"model": "llama-3-8b", "prompt": ["First prompt.", "Second, INV_7731."]},
         "response": {"id": "cmpl-2", "choices": [{"index": 0, "text": "One."}, {"index": 1, "text": "Two."}]}},
        {"name": "completions_token_ids", "request": {"model": "llama-3-8b", "prompt": [101, 2023, 2003, 102]},
         "response": {"id": "cmpl-3", "choices": [{"index": 0, "text": "tokens in, text out", "finish_reason": "stop"}]}},
        {"name": "completions_stream", "request": {"model": "llama-3-8b", "prompt": SECRET, "stream": True},
         "events": [{"id": "cmpl-s", "choices": [{"index": 0, "text": "Hendrikson ", "finish_reason": None}]},
                    {"id": "cmpl-s", "choices": [{"index": 0, "text": "Ltd.", "finish_reason": "stop"}]}]},
    ]


def responses_inputs() -> list[dict[str, Any]]:
    """The Responses API: items in and out, a string input, a stream whole and a stream cut."""
    given = [
        {"role": "user", "content": [{"type": "input_text", "text": SECRET}, {"type": "input_image", "image_url": "x"}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": TOOL_ARGS},
        {"type": "function_call_output", "call_id": "c1", "output": "INV_7731: 48213 EUR, open."},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Checked the ledger."}]},
        {"type": "web_search_call", "id": "ws", "status": "completed"},
    ]
    output = [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": REASONING}], "summary": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Hendrikson Ltd owes 48213 EUR.", "annotations": []},
            {"type": "refusal", "refusal": "No account numbers."}]},
        {"type": "function_call", "name": "pay", "arguments": '{"iban": "NL91ABNA0417164300"}'},
    ]
    usage = {"input_tokens": 200, "output_tokens": 30, "input_tokens_details": {"cached_tokens": 128}}
    created = {"type": "response.created", "response": {"id": "resp_s", "status": "in_progress", "output": []}}
    text = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hendrikson Ltd"}]}
    return [
        {"name": "responses_api", "request": {"model": "gpt-4.1", "instructions": "Answer as the bookkeeper.", "input": given},
         "response": {"id": "resp_1", "object": "response", "status": "completed", "output": output, "usage": usage}},
        {"name": "responses_api_string_input", "request": {"model": "gpt-4.1", "input": "What is INV_7731?"},
         "response": {"id": "resp_2", "status": "incomplete", "output": [
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "An invoice."}]}]}},
        {"name": "responses_stream", "request": {"model": "gpt-4.1", "input": SECRET, "stream": True},
         "events": [
             created,
             {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "Hendrikson "},
             {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "Ltd"},
             {"type": "response.completed", "response": {"id": "resp_s", "status": "completed", "output": [text],
                                                         "usage": {"input_tokens": 40, "output_tokens": 3}}},
         ]},
        {"name": "responses_stream_cut", "request": {"model": "gpt-4.1", "input": SECRET, "stream": True},
         "events": [
             created,
             {"type": "response.output_item.done", "output_index": 0,
              "item": {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Reading the note."}]}},
             {"type": "response.output_text.delta", "output_index": 1, "content_index": 0, "delta": "Hendrikson "},
             {"type": "response.output_text.delta", "output_index": 1, "content_index": 1, "delta": "(part two) "},
             {"type": "response.output_text.delta", "output_index": 1, "content_index": 0, "delta": "owes 48213"},
             {"type": "response.function_call_arguments.delta", "output_index": 2, "delta": '{"iban": "NL91'},
         ]},
    ]


def record_inputs() -> list[dict[str, Any]]:
    """What the record's own rules decide: quotes, public texts, long texts, markers, names, callers,
    odd values, refusals, hard Unicode."""
    long_prompt = " ".join(f"paragraph {i} of the customer's contract says clause {i * 17}." for i in range(1200))
    markers = [
        MARKER, MARKER.lower(), MARKER, "kVc-0123ABCD-" + "F" * 32, "\u212aVC-0123abcd-" + "0" * 32,
        "KVC-0123abcd-" + "0" * 31, "KVC-0123abcd-" + "0" * 33, *[f"KVC-{i:08x}-" + "a" * 32 for i in range(40)],
    ]
    hostile = "alice\u202egnp.exe\x1b[31m\n[FAKE] resolved\u200b\x9b2J\u2066x\u2069\ufeff  "
    hard = "İstanbul DİYARBAKIR ΟΔΟΣ οδος Οδός नमस्ते दुनिया e\u0301 ＡＢＣ"
    fine = _answer(_said("Fine."))
    return [
        {"name": "own_quotes_are_zero",
         "request": _chat({"role": "user", "content": f"Repeat my note word for word: {SECRET}"}),
         "response": _answer(_said(f"Your note: {SECRET}"))},
        {"name": "public_texts_are_no_ones", "public_texts": [LICENCE],
         "request": _chat({"role": "user", "content": f"Is this licence fine? {LICENCE} Ask Hendrikson Ltd."}),
         "response": _answer(_said(f"The text reads: {LICENCE} It is the MIT licence."))},
        {"name": "long_prompt_truncated_and_capped", "request": _chat({"role": "user", "content": long_prompt}),
         "response": _answer(_said(long_prompt[:5000]))},
        {"name": "markers_of_the_answer", "request": _chat(USER), "response": _answer(_said(" ".join(markers)))},
        {"name": "hostile_names",
         "gateway": {"caller": hostile, "caller_kind": "end_user", "api_base": "http://10.0.0.7:8000/v1\x00\u2028",
                     "model_group": "g" * 300},
         "request": {"model": "m\x85odel\ue000\ud800", "messages": [USER]},
         "response": {"id": "chatcmpl-\t" + "x" * 250,
                      "choices": [{"message": {"content": "ok"}, "finish_reason": "st\u00a0\u00a0op"}]}},
        {"name": "caller_by_key", "gateway": {"caller": "sk-the-raw-key", "caller_kind": "key_hash", "key": "sk-the-raw-key"},
         "request": _chat(USER), "response": fine},
        {"name": "caller_by_digest",
         "gateway": {"caller": "HASHED-JWT-" + "AB" * 32, "caller_kind": "key_hash", "key": " " + "cd" * 32 + " "},
         "request": _chat(USER), "response": fine},
        {"name": "unknown_caller_kind_and_odd_values",
         "gateway": {"caller": "", "caller_kind": "admin", "key": "", "status": 99, "latency_seconds": -1,
                     "ttft_seconds": 604800.5, "time": -5},
         "request": _chat(USER), "response": {"id": "x", "choices": [], "usage": {"prompt_tokens": -3, "completion_tokens": True}}},
        {"name": "refused_by_admission",
         "gateway": {"status": 400, "refused": {"by": "admission", "tokens": 90000, "kv_pool_tokens": 2048}},
         "request": _chat(USER), "response": None},
        {"name": "refused_by_quarantine",
         "gateway": {"status": 503, "refused": {"by": "quarantine", "incident_id": 42}, "latency_seconds": 0.000001},
         "request": _chat(USER), "response": None},
        {"name": "unicode_exchange", "request": _chat({"role": "user", "content": hard}),
         "response": _answer(_said("ISTANBUL, ΟΔΟΣ, नमस्ते: lone \ud800 and \udfff"))},
    ]
# fmt: on


def exchange_inputs() -> list[dict[str, Any]]:
    """Every exchange: its name, what the gateway knows, the request, and the response or stream."""
    return chat_inputs() + completion_inputs() + responses_inputs() + record_inputs()


def exchange_record(case: dict[str, Any]) -> dict[str, Any]:
    """Return the record the Python tap makes of one exchange of :func:`exchange_inputs`."""
    facts = {**GATEWAY, **case.get("gateway", {})}
    tap = Fingerprinter(KEY)
    if case.get("public_texts"):
        tell(tap, public_prints(case["public_texts"], tap))
    exchange = exchange_of_bodies(
        case["request"], case.get("response"), events=case.get("events"), started=facts["time"],
        caller=facts["caller"], caller_kind=facts["caller_kind"], key=facts["key"],
        api_base=facts["api_base"], model_group=facts["model_group"], status=facts["status"],
        latency_seconds=facts["latency_seconds"], ttft_seconds=facts["ttft_seconds"],
    )  # fmt: skip
    if facts.get("refused"):
        exchange = dataclasses.replace(exchange, refused=Refusal(**facts["refused"]))
    record = summarize(exchange, tap)
    record["id"] = facts["record_id"]  # the tap's random id, fixed for the vector
    return record


def exchanges() -> dict[str, Any]:
    made = []
    for case in exchange_inputs():
        encoded = wire.encode(exchange_record(case))
        facts = {**GATEWAY, **case.get("gateway", {})}
        made.append(
            {**case, "gateway": facts, "record": json.loads(encoded), "encoded": encoded.decode("ascii")}
        )
    return {"version": wire.VERSION, "key_hex": KEY_HEX, "exchanges": made}
