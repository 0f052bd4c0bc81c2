"""The Python tap against the protocol's golden vectors (``tests/fixtures/wire/``,
``docs/tap-protocol.md``; what each file holds: ``tests/tap/wire_vectors.py``).

A tap written in another language (``taps/node/`` is one) is correct when it makes the same outputs
of the same inputs. The vectors are the Python tap's outputs, written once and read here: a change
of the Python tap that moves any of them fails this test, and is a change of the protocol (its
version goes up in ``kvcanary.wire``, the document's heading and every file).

Regenerate after a deliberate protocol change: ``.venv/bin/python -m tests.tap.test_wire_golden --write``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from kvcanary import wire
from kvcanary.tap.words import CASE_RANGES, LOWERCASE, SEPARATOR_RANGES, is_separator, lower
from tests.tap.blake2b_reference import blake2b
from tests.tap.exchange_vectors import exchange_inputs
from tests.tap.wire_vectors import FILES

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "wire"
DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "tap-protocol.md"
_SURROGATE = re.compile("[\ud800-\udfff]")
_NUMBERS = re.compile(r"\[\n((?:\s*-?\d+,?\n)+)\s*\]")


def dumped(data: dict[str, Any]) -> str:
    """``data`` as the vector files hold it: JSON, readable (non-ASCII as it is), a lone surrogate
    (which UTF-8 cannot write) as its escape."""
    text = json.dumps(data, indent=1, ensure_ascii=False)
    # A list of numbers on one line (a raw newline is never inside a JSON string: only between values).
    text = _NUMBERS.sub(lambda m: "[" + ",".join(m.group(1).split()).replace(",,", ",") + "]", text)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text) + "\n"


def load(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    return loaded


@pytest.mark.parametrize("name", sorted(FILES))
def test_the_python_tap_makes_the_golden_vectors(name: str) -> None:
    golden, made = load(name), json.loads(dumped(FILES[name]()))
    assert golden["version"] == wire.VERSION
    for section in made:
        assert made[section] == golden[section], f"{name}: the tap's {section} moved: a protocol change"


def test_the_document_the_vectors_and_the_wire_say_one_version() -> None:
    heading = DOC.read_text(encoding="utf-8").splitlines()[0]
    assert heading == f"# The tap protocol, version {wire.VERSION}"
    assert {load(name)["version"] for name in FILES} == {wire.VERSION}
    assert wire.VERSION in wire.SPOKEN_VERSIONS


def ranges_in(text: str) -> list[tuple[int, int]]:
    """Return the code point ranges ``U+XXXX`` or ``U+XXXX`` to ``U+YYYY`` (an en dash between) of
    ``text``, in order."""
    found = re.findall(r"U\+([0-9A-F]{4,6})(?:\u2013U\+([0-9A-F]{4,6}))?", text)
    return [(int(a, 16), int(b or a, 16)) for a, b in found]


def between(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


def test_the_documents_tables_are_the_rules_own() -> None:
    """A reader with the document alone reads the same tables the taps use."""
    doc = DOC.read_text(encoding="utf-8")
    assert ranges_in(between(doc, "The separators are these", "That is ASCII")) == list(SEPARATOR_RANGES)
    assert ranges_in(between(doc, "**Lower case.** A code point in", "becomes its")) == list(CASE_RANGES)
    names = between(doc, "## Names", "## Markers")
    assert ranges_in(between(names, "(Unicode 17's Cf:", ": bidi")) == list(wire.FORMAT_RANGES)
    private = ranges_in(between(names, "**private-use** character (", ") becomes"))
    assert private == list(wire.PRIVATE_RANGES[1:])  # the surrogates, named apart
    assert ranges_in(between(names, "a **break** (", ": it could")) == list(wire.BREAK_RANGES)
    assert ranges_in(between(names, "each run of white space (", ") becomes")) == list(wire.SPACE_RANGES)
    assert f"`{wire.MARKER_PATTERN}`" in doc


def test_blake2b_as_the_document_states_it_is_hashlibs() -> None:
    for v in load("golden.json")["blake2b"]:
        key = bytes.fromhex(v["key_hex"])[:64]
        made = blake2b(
            bytes.fromhex(v["data_hex"]), key=key, person=v["person"].encode(), digest_size=v["digest_size"]
        )
        assert made.hex() == v["digest_hex"]
    # An 8-byte digest is its own (the length is in the parameter block), not a cut 64-byte one.
    assert hashlib.blake2b(b"acme", digest_size=8).digest() != hashlib.blake2b(b"acme").digest()[:8]


def test_the_hard_cases_are_hard_for_pythons_own_rules() -> None:
    """Each hard case is one where a standard library's rule would print otherwise: the vectors
    pin what the protocol's rule does there."""
    hard = load("unicode.json")["hard_cases"]
    assert "İstanbul".lower() != lower("İstanbul") == "istanbul"  # Python adds a combining dot
    assert "ΟΔΟΣ".lower() == "οδος" != lower("ΟΔΟΣ") == lower("οδος") == "οδοσ"  # no final sigma
    assert len(re.findall(r"\w+", "नमस्ते")) > 1 and hard["devanagari"]["words"][0] == "नमस्ते"  # marks split it
    assert "ᲐᲑᲒ".lower() != "ᲐᲑᲒ" and lower("ᲐᲑᲒ") == "ᲐᲑᲒ"  # Mtavruli: outside the case ranges
    assert hard["lone_surrogates"]["code_points_of_text"].count(0xD800) == 1
    assert hard["combining_marks"]["words"][:2] == ["cafe\u0301", "café"]  # a mark ends no word
    assert hard["digits"]["distinctive_words"] == ["2026", "0123"]  # ASCII digits only
    assert hard["long_astral"]["truncated"] and hard["long_astral"]["code_points"] > 65_536


def test_the_case_table_is_the_simple_lowercase_mapping_within_its_ranges() -> None:
    table = {a: b for a, b in load("unicode.json")["lowercase"]}
    assert table == LOWERCASE
    for first, last in CASE_RANGES:
        for code in range(first, last + 1):
            if unicodedata.category(chr(code)) == "Lu" and code not in (0x0130,):
                assert chr(table.get(code, code)) == chr(code).lower()
    # Lower-casing keeps every word character a word character, and every separator one.
    assert all(is_separator(a) == is_separator(b) for a, b in table.items())


def test_every_shape_the_protocol_reads_has_a_whole_exchange() -> None:
    made = {case["name"]: case for case in load("exchanges.json")["exchanges"]}
    assert {c["name"] for c in exchange_inputs()} == set(made)
    records = {name: case["record"] for name, case in made.items()}
    assert records["chat_stream"]["stream"] and not records["chat_string"]["stream"]
    assert records["refused_by_admission"]["refused"]["by"] == "admission"
    for name in ("refused_by_admission", "refused_by_quarantine"):
        assert records[name]["fingerprints"] == {"prompt": [], "response": []}
        assert records[name]["prompt"]["chars"] > 0  # its size is sent, its prints are not
    own = records["own_quotes_are_zero"]["fingerprints"]["response"]
    assert own.count(0) >= 5 and own.count(0) >= len(own) - 1  # but "Your note: ..."
    public = records["public_texts_are_no_ones"]["fingerprints"]["response"]
    assert public.count(0) >= 5
    long = records["long_prompt_truncated_and_capped"]
    assert long["truncated"] and len(long["fingerprints"]["prompt"]) == wire.MAX_FINGERPRINTS
    markers = records["markers_of_the_answer"]["markers"]
    assert len(markers) == wire.MAX_MARKERS and not any("\u212a" in m for m in markers)
    hostile = records["hostile_names"]
    assert all(hostile[n].isprintable() for n in ("caller", "api_base", "model", "upstream_id"))
    assert records["caller_by_digest"]["caller"] == "ab" * 32
    assert records["responses_stream_cut"]["response_chars"] > 0


def test_every_record_of_the_vectors_is_one_the_monitor_takes() -> None:
    from kvcanary.monitor.traffic.schema import TrafficRecordWire

    for case in load("exchanges.json")["exchanges"]:
        TrafficRecordWire.model_validate_json(case["encoded"])
        assert wire.encode(case["record"]).decode() == case["encoded"]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, make in FILES.items():
        data = make()
        text = dumped(data)
        assert json.loads(text) == json.loads(json.dumps(data)), f"{name}: not what a reader reads"
        (FIXTURES / name).write_text(text, encoding="utf-8")
        print(f"wrote {FIXTURES / name} ({len(text.encode()) // 1024} KiB)")
