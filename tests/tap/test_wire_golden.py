"""The tap's wire against its golden vectors (``tests/fixtures/wire/golden.json``, ``docs/tap-protocol.md``).

A tap written in another language (a Go or Rust gateway's) is correct when it makes the same
fingerprints of the same texts under the same key, the same routing key and partition of the same
``api_base``, and the same messages of the same batch, byte for byte. The vectors are the Python
tap's outputs, written once and read here: a change of the Python tap that moves any of them fails
this test, and is a change of the protocol (its version in the file and the doc goes up).

Regenerate after a deliberate protocol change: ``.venv/bin/python -m tests.tap.test_wire_golden --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kvcanary import wire
from kvcanary.tap.distinctive import TokenPrints
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.jetstream import messages_of
from kvcanary.tap.record import key_digest
from kvcanary.tap.sender import Batch

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "wire" / "golden.json"
#: The protocol version the vectors are of (``docs/tap-protocol.md``).
VERSION = 2
KEY = b"kvcanary-golden-vector-key-0001!"
TEXTS: dict[str, str] = {
    "empty": "",
    "seven_words": "one two three four five six seven",
    "eight_words": "one two three four five six seven eight",
    "sentence": "The quarterly report for Acme Corp shows revenue of 4.2 million euros, up 12 percent.",
    "cased_and_punctuated": "ACME corp. -- Acme CORP; acme, Corp! (the same words, lower-cased, in order)",
    "unicode": "Café Zürich: naïve façade, 東京タワー and Ωmega; ß is one word, 3½ is two.",
    "passage": " ".join(f"word{i % 37} token{i % 11}" for i in range(120)),
    # Past MAX_TEXT_CHARS (64 KiB): fingerprinted from its first and last 32 KiB only.
    "long": "".join(f"line {i}: the customer asked about order {i * 7919 % 100003}.\n" for i in range(1400)),
}
API_BASES = [
    "http://10.0.0.7:8000/v1",
    " HTTP://Gateway.Example.com:8000/Prefix/V1/ ",
    "https://api.example.com/v1/",
    "http://h/a/b/",
    "http://h",
    "",
]
CALLERS = ["sk-1234567890abcdef", "team-a", ""]


def records() -> list[dict[str, Any]]:
    """Four records of two deployments, as the tap sends them (only the fields a message needs)."""
    return [
        {"id": f"tap-{i:024x}", "api_base": API_BASES[i % 2], "caller": f"team-{i}", "status": 200,
         "fingerprints": {"prompt": [i + 1, 2 * i + 3], "response": [0, i + 7]}}
        for i in range(4)
    ]  # fmt: skip


def routing_of(url: str) -> dict[str, Any]:
    """Return the routing key of ``url`` and its partition among 16 and among 7."""
    key, p16, p7 = wire.api_base_key(url), wire.partition_of(url, 16), wire.partition_of(url, 7)
    return {"url": url, "key": key, "partition_16": p16, "partition_7": p7}


def vectors() -> dict[str, Any]:
    """Return the Python tap's outputs for the fixed inputs above: what the golden file holds."""
    tap, tokens = Fingerprinter(KEY), TokenPrints(KEY)
    texts = {}
    for name, text in TEXTS.items():
        prints, truncated = tap.fingerprints(text)
        texts[name] = {"text": text, "fingerprints": prints, "truncated": truncated,
                       "whole": tap.whole(text), "distinctive": tokens.of(text)}  # fmt: skip
    batch = Batch("0123456789abcdef0123456789abcdef", "gw-1", 0, records())
    messages = {
        f"limit_{limit}": [
            {"subject": subject, "headers": headers, "payload": payload.decode(), "first_record": first}
            for subject, payload, headers, first in messages_of(batch, 16, "kvcanary.traffic", limit)
        ]
        for limit in (512 * 1024, 300)
    }
    return {
        "version": VERSION,
        "key_hex": KEY.hex(),
        "texts": texts,
        "api_bases": [routing_of(url) for url in API_BASES],
        "key_digests": {caller: key_digest(caller, KEY) for caller in CALLERS},
        "batch": {"id": batch.id, "gateway": batch.gateway, "records": batch.records},
        "exchange": exchange_vector(tokens),
        "messages": messages,
    }


def exchange_vector(tokens: TokenPrints) -> dict[str, Any]:
    """A record's distinctive tokens of one exchange: the answer's less those its prompt holds."""
    prompt = "Invoice INV_7731 for Hendrikson Ltd: 48213 EUR, due 2027. Call Marta."
    response = "Hendrikson owes 48213; Marta Oyelaran (x86 team) confirmed on 2026-12-04."
    asked, said = tokens.exchange(prompt, response)
    return {"prompt": prompt, "response": response, "distinctive": {"prompt": asked, "response": said}}


def test_the_python_tap_makes_the_golden_vectors() -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    made = vectors()
    assert golden["version"] == VERSION
    for section in ("texts", "api_bases", "key_digests", "batch", "messages", "exchange"):
        assert made[section] == golden[section], f"the tap's {section} moved: a protocol change"


def test_the_vectors_cover_what_a_second_implementation_must_get_right() -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    texts = golden["texts"]
    assert texts["empty"]["fingerprints"] == [] and texts["seven_words"]["fingerprints"] == []
    assert texts["long"]["truncated"] is True and texts["sentence"]["truncated"] is False
    assert all(0 < f < 2**51 for t in texts.values() for f in t["fingerprints"])  # 0 is OWN
    assert len({b["key"] for b in golden["api_bases"][:2]}) == 2
    assert golden["api_bases"][1]["key"] == "http://gateway.example.com:8000/prefix"
    assert len(golden["messages"]["limit_300"]) > len(golden["messages"]["limit_524288"])  # split


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(vectors(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")
