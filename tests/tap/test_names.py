"""Names a customer or an engine writes (LiteLLM's ``end_user``, a response id, a model) leave the
tap printable: nothing in them can start an escape sequence, a new line or reorder what is shown."""

from __future__ import annotations

import pytest

from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.tap import Tap
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.litellm_payload import exchange_of
from kvcanary.tap.record import MAX_NAME_CHARS, Exchange, printable_name, summarize
from tests.tap.receiver import Monitor, wait_until

KEY = b"a-test-fingerprint-key-0123456789"
NAMES = ("upstream_id", "caller", "api_base", "model", "model_group", "finish_reason")
#: Each class of character a name must not carry, and what stands in its place.
BREAKS = {
    "C0 ESC": "\x1b", "C0 NUL": "\x00", "C0 LF": "\n", "C0 CR": "\r", "C0 TAB": "\t", "C0 BEL": "\x07",
    "DEL": "\x7f",
    "C1 PAD": "\x80", "C1 NEL": "\x85", "C1 CSI": "\x9b", "C1 APC": "\x9f",
    "line separator": "\u2028", "paragraph separator": "\u2029",
}  # fmt: skip
HIDDEN = {
    **{f"bidi U+{c:04X}": chr(c) for c in range(0x202A, 0x202F)},  # embeddings and overrides
    **{f"bidi isolate U+{c:04X}": chr(c) for c in range(0x2066, 0x206A)},
    **{f"zero-width U+{c:04X}": chr(c) for c in range(0x200B, 0x2010)},  # ZWSP, ZWNJ, ZWJ, LRM, RLM
    "BOM U+FEFF": "\ufeff",
    "lone high surrogate": "\ud83d", "lone low surrogate": "\udfff",
}  # fmt: skip


def record_with_names(text: str) -> dict[str, object]:
    """Summarize an exchange whose every name is ``text``, the caller an end user's."""
    exchange = Exchange(text, 1.8e9, text, "end_user", text, model=text, model_group=text, finish_reason=text)
    return summarize(exchange, Fingerprinter(KEY))


@pytest.mark.parametrize("char", BREAKS.values(), ids=BREAKS.keys())
def test_a_control_or_line_break_in_a_name_becomes_a_space(char: str) -> None:
    record = record_with_names(f"acme{char}[FAKE] resolved")
    assert {record[name] for name in NAMES} == {"acme [FAKE] resolved"}  # one line, nothing escaped


@pytest.mark.parametrize("char", HIDDEN.values(), ids=HIDDEN.keys())
def test_a_format_character_or_lone_surrogate_in_a_name_shows_as_a_replacement(char: str) -> None:
    record = record_with_names(f"acme{char}corp")
    assert {record[name] for name in NAMES} == {"acme\ufffdcorp"}  # tampering shows; names stay apart


def test_a_printable_name_is_kept_as_sent_and_every_name_is_bounded() -> None:
    assert printable_name("Équipe 東京 / model:v2 (beta)") == "Équipe 東京 / model:v2 (beta)"
    hostile = printable_name("\u202e" * 10_000 + "x" * 10_000)
    assert len(hostile) == MAX_NAME_CHARS and hostile.isprintable()
    assert len(printable_name("y" * 10_000)) == MAX_NAME_CHARS


def test_hostile_names_through_a_real_tap_reach_the_monitor_printable(monitor: Monitor) -> None:
    """A LiteLLM payload whose customer (``end_user``), id and model carry an ANSI sequence, a fake
    second line, a bidi override, an isolate, C1 controls and zero-width characters."""
    hostile = "alice\u202egnp.exe\x1b[31m\n[FAKE] resolved\u200b\x9b2J\u2066x\u2069\ufeff"
    choice = {"message": {"content": "hi"}, "finish_reason": hostile}
    payload = {
        "id": f"chatcmpl-{hostile}", "model": f"gpt\x85{hostile}", "model_group": hostile,
        "api_base": f"http://x/v1{hostile}", "end_user": hostile, "metadata": {},
        "messages": [{"role": "user", "content": "hi"}], "response": {"choices": [choice]},
    }  # fmt: skip
    tap = Tap(monitor.server.url, "tok", KEY, gateway="gw\x1b]0;owned\x07", flush_seconds=0.05)
    tap.observe(exchange_of(payload, 200))
    wait_until(lambda: len(monitor.records()) == 1)
    tap.close()
    [record] = monitor.posted()
    assert record["caller_kind"] == "end_user"
    for name in NAMES:
        assert record[name].isprintable() and "alice" in record[name], (name, record[name])
    assert monitor.bodies[0]["gateway"] == "gw ]0;owned"
    TrafficRecord.model_validate(record)  # and the monitor takes it
