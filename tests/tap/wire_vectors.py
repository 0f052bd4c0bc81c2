"""The golden vectors of the tap protocol (``tests/fixtures/wire/``, ``docs/tap-protocol.md``): fixed
inputs, and what the Python tap makes of them. A tap in another language reads the same files and
must make the same outputs, byte for byte where bytes are given; the monitor's reader must read
the vectors' messages and bodies as records (``tests/monitor/traffic/test_wire_vectors.py``).

- ``golden.json``: texts (their words, fingerprints, whole-prompt print, distinctive tokens), BLAKE2b
  with each of the protocol's parameter sets, routing keys and partitions, key digests;
- ``unicode.json``: the word and case rules' tables and the hard cases (``İ``, ``Σ``/``ς``,
  combining marks, Devanagari, surrogates, scripts outside the case ranges, digits of other scripts);
- ``exchanges.json``: whole exchanges, request and response bodies (or a stream's chunks or
  events) in and the record out, for every shape the protocol reads, refused requests, public texts,
  long texts, markers and names;
- ``framing.json``: how numbers and strings are written, batch bodies and their 413 halves' ids,
  NATS messages (partitions, parts, drops, a record too large for the server), names and markers.

Written by ``.venv/bin/python -m tests.tap.test_wire_golden --write`` after a deliberate protocol
change, which is a new version (``kvcanary.wire.VERSION``, the document's heading, each file's
``version``).
"""

# ruff: noqa: RUF001 - the hard cases are letters that look like others, on purpose
from __future__ import annotations

import hashlib
import json
from typing import Any

from kvcanary import wire
from kvcanary.tap.distinctive import TokenPrints, distinctive_words
from kvcanary.tap.fingerprints import Fingerprinter, cut
from kvcanary.tap.record import key_digest
from kvcanary.tap.words import CASE_RANGES, EXTRA_LOWER, LOWERCASE, SEPARATOR_RANGES, lower, scalars, words
from tests.tap.exchange_vectors import KEY, MARKER, exchanges


def _letters(i: int) -> str:
    """The ``i``-th word of three lower-case letters (distinct for ``i`` under 17,576; none distinctive)."""
    return "".join(chr(97 + i // 26**k % 26) for k in range(3))


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
    # 1,100 distinct 8-word runs: about 275 kept, under the cap; the next one is over it.
    "many_prints": " ".join(_letters(i) for i in range(1107)),
    "over_the_cap": " ".join(_letters(i) for i in range(6000)),
}
HARD: dict[str, str] = {
    "dotted_capital_i": "İstanbul İSTANBUL istanbul ıstanbul DİYARBAKIR diyarbakır",
    "sigma": "ΟΔΟΣ οδος Οδός ὁδός ΣΊΣΥΦΟΣ σίσυφος Σ",
    "devanagari": "नमस्ते दुनिया। यह हिन्दी है॥ क्षत्रिय",
    "combining_marks": "cafe\u0301 café e\u0301\u0301x a\u0308b",
    "lone_surrogates": "lone \ud800 high, lone \udfff low, \ude00\ud83d a low then a high",
    "kelvin_angstrom_ohm": "\u212a \u212b \u2126 kelvin \u212aelvin",
    "fullwidth": "ＡＢＣ１２３ ａｂｃ！ＡＢＣ＿ｘ",
    "arabic": "مرحبا، عالم؛ ١٢٣٤ 2026 ٪",
    "hebrew": "שלום־עולם ״מילה״",
    "cjk": "東京タワー、２０２６年の人々。「引用」",
    "emoji": "ok👍🏽ok 👨‍👩‍👧 family ☕ ⚡️x",
    "astral_letters": "𝐀𝐁𝐂 abc 𐐀𐐨 Deseret",
    "outside_the_case_ranges": "ᲐᲑᲒ აბგ ᎠᎡᎢ ꭰꭱꭲ Ⰰⰰ",
    "digits": "٢٠٢٦ 2026 ２０２６ 3½ x² Ⅻ ⅻ 0123 123",
    "format_and_spaces": "co\u00adoperate zero\u200bwidth no\u2060break a\u00a0b\u2003c\u3000d",
    "titlecase_digraphs": "ǄEMAL ǅemal ǆemal",
    "sharp_s": "STRASSE Straße STRAẞE",
    "greek_extended": "ᾈ ᾀ ᾼ ᾳ Ἀθῆναι",
    "symbols": "a→b a≤b ©2026 ™ € x_y ﬁle",
    "long_astral": "𝐀b " * 22_000,
}
API_BASES = [
    "http://10.0.0.7:8000/v1",
    " HTTP://Gateway.Example.com:8000/Prefix/V1/ ",
    "https://api.example.com/v1/",
    "http://h/a/b/",
    "http://h",
    "",
    "http://ÉCOLE.example/V1",  # only ASCII letters are lower-cased
    "http://h/v1/v1/",  # one /v1 stripped
    "\thttp://h:1/\u00a0",  # NBSP is no ASCII blank: kept
]
KEY_VALUES = [
    "sk-1234567890abcdef",
    "SK-1234567890ABCDEF",  # a key's case is kept: another caller
    "team-a",
    "",
    "   ",
    "  sk-padded \n",
    "a" * 64,
    "A" * 64,
    "hashed-jwt-" + "0123456789abcdef" * 4,
    "HASHED-JWT-" + "0123456789ABCDEF" * 4,
    "hashed-jwt-not-a-digest",
    "ab" * 31,
    "clé-ünïcode",
    "lone-\ud800-surrogate",
]


def hex_key() -> str:
    return KEY.hex()


def text_vector(text: str, tap: Fingerprinter, tokens: TokenPrints) -> dict[str, Any]:
    """What the tap makes of one text: its words (as cut, case kept and lowered), fingerprints,
    whole print, distinctive tokens and their prints, and its size."""
    prints, truncated = tap.fingerprints(text)
    read = words(scalars(cut(text)))
    return {
        "text": text,
        "code_points": len(text),
        "utf8_bytes": len(scalars(text).encode("utf-8")),
        "words": read if len(read) <= 64 else None,
        "lowered": [lower(w) for w in read] if len(read) <= 64 else None,
        "fingerprints": prints,
        "truncated": truncated,
        "whole": tap.whole(text),
        "distinctive_words": distinctive_words(text),
        "distinctive": tokens.of(text),
    }


def blake2b_vectors() -> list[dict[str, Any]]:
    """BLAKE2b under each parameter set the protocol uses: keyed 8 bytes (a word), keyed 8 bytes
    with a person (the whole prompt, a token), unkeyed 16 bytes (a 413 half's id)."""
    cases = [
        (b"", KEY, b"", 8),
        (b"acme", KEY, b"", 8),
        (b"x" * 129, KEY, b"", 8),
        (b"acme", KEY, b"kvc-whole", 8),
        (b"acme", KEY, b"kvc-token", 8),
        ("ünïcode".encode(), KEY, b"kvc-token", 8),
        (b"a" * 200, KEY[:16], b"kvc-whole", 8),
        (b"0123456789abcdef0123456789abcdef.0", b"", b"", 16),
        (b"abc", b"", b"", 64),
        (b"acme", KEY * 2 + b"!", b"", 8),  # a key over 64 bytes: the tap uses its first 64
    ]
    return [
        {
            "data_hex": data.hex(),
            "key_hex": key.hex(),
            "person": person.decode(),
            "digest_size": size,
            "digest_hex": hashlib.blake2b(data, key=key[:64], person=person, digest_size=size).hexdigest(),
        }
        for data, key, person, size in cases
    ]


def golden() -> dict[str, Any]:
    tap, tokens = Fingerprinter(KEY), TokenPrints(KEY)
    prompt = "Invoice INV_7731 for Hendrikson Ltd: 48213 EUR, due 2027. Call Marta."
    response = "Hendrikson owes 48213; Marta Oyelaran (x86 team) confirmed on 2026-12-04."
    asked, said = tokens.exchange(prompt, response)
    return {
        "version": wire.VERSION,
        "key_hex": hex_key(),
        "texts": {name: text_vector(text, tap, tokens) for name, text in TEXTS.items()},
        "blake2b": blake2b_vectors(),
        "api_bases": [
            {
                "url": url,
                "key": wire.api_base_key(url),
                "partition_16": wire.partition_of(url, 16),
                "partition_7": wire.partition_of(url, 7),
            }
            for url in API_BASES
        ],
        "key_digests": [{"value": v, "digest": key_digest(v, KEY)} for v in KEY_VALUES],
        "exchange": {
            "prompt": prompt,
            "response": response,
            "distinctive": {"prompt": asked, "response": said},
        },
    }


def unicode() -> dict[str, Any]:
    tap, tokens = Fingerprinter(KEY), TokenPrints(KEY)
    hard = {}
    for name, text in HARD.items():
        vector = text_vector(text, tap, tokens)
        # Every reader can read code points, whatever its JSON reader does with a lone surrogate.
        vector["code_points_of_text"] = [ord(c) for c in text] if len(text) < 200 else None
        hard[name] = vector
    return {
        "version": wire.VERSION,
        "key_hex": hex_key(),
        "separator_ranges": [list(r) for r in SEPARATOR_RANGES],
        "case_ranges": [list(r) for r in CASE_RANGES],
        "extra_lowercase": [[a, b] for a, b in EXTRA_LOWER.items()],
        "lowercase": [[a, b] for a, b in sorted(LOWERCASE.items())],
        "hard_cases": hard,
    }


# --- bytes ---------------------------------------------------------------------------------------

BATCH_ID = "0123456789abcdef0123456789abcdef"
NAMES = [
    "plain-name",
    "  two  spaces  ",
    "tab\tand\nnewline",
    "bidi\u202eoverride",
    "zero\u200bwidth",
    "nbsp\u00a0\u2003em",
    "private\ue000use",
    "surrogate\ud800x",
    "c1\x85\x9bcsi",
    "line\u2028sep",
    "tag\U000e0041s",
    "Équipe 東京 / model:v2 (beta)",
    "x" * 199 + " y",
    "\u202e" * 900 + "tail",
    "y" * 300,
    "soft\u00adhyphen",
    "egyptian\U00013439format",
]
MARKER_TEXTS = [
    f"plain {MARKER} end",
    f"{MARKER}{MARKER}",
    f"{MARKER.lower()} and {MARKER.upper().replace('KVC', 'kvc')}",
    "\u212aVC-0123abcd-" + "0" * 32,
    "ＫＶＣ-0123abcd-" + "0" * 32,
    "xKVC-0123abcd-" + "0" * 32 + "0",
    "KVC-0123abcd-" + "0" * 31 + "g",
]
SECONDS = [0.0, 1.0, 0.5, 0.0078125, 1e-7, 4.9999995e-7, 0.25, 1767225600.123456, 1767225600.0000005,
           604800.0, 8589934592.0, 123.456789, 2.2250738585072014e-308]  # fmt: skip
STRINGS = ["plain", 'quote " and \\ backslash', "é東😀", "\x00\x1f\x7f\x80", "\b\f\n\r\t/", "\ud800"]


def framing_records() -> list[dict[str, Any]]:
    """Records of three deployments, with non-ASCII names and floats, as a tap writes them (names
    printable, seconds to the microsecond: what a reader of the bytes reads back)."""
    bases = ["http://10.0.0.7:8000/v1", "HTTP://Gateway.Example.com:8000/Prefix/V1/", "http://h/é"]
    made = [
        {
            "id": f"tap-{i:024x}",
            "upstream_id": f"chatcmpl-{i}",
            "time": 1767225600.5 + i / 3,
            "caller": f"équipe-{i % 2}",
            "caller_kind": "team",
            "api_base": bases[i % 3],
            "status": 200,
            "latency_seconds": 0.1 * i,
            "ttft_seconds": None,
            "fingerprints": {"prompt": [i + 1, 2 * i + 3], "response": [0, i + 7]},
        }
        for i in range(7)
    ]
    return [json.loads(wire.encode(record)) for record in made]


def message_cases() -> list[dict[str, Any]]:
    huge = {
        **framing_records()[0],
        "id": "tap-huge",
        "fingerprints": {"prompt": [2**52] * 1024, "response": []},
    }
    return [
        {
            "name": "one_message_a_partition",
            "dropped": 0,
            "partitions": 16,
            "max_payload": 1024 * 1024,
            "records": framing_records(),
        },
        {
            "name": "parts_at_a_small_limit",
            "dropped": 0,
            "partitions": 16,
            "max_payload": 1024 + 420,
            "records": framing_records(),
        },
        {
            "name": "drops_ride_the_first",
            "dropped": 12,
            "partitions": 7,
            "max_payload": 1024 * 1024,
            "records": framing_records(),
        },
        {
            "name": "a_record_too_large_for_the_server",
            "dropped": 3,
            "partitions": 16,
            "max_payload": 8 * 1024,
            "records": [huge, *framing_records()[:2]],
        },
        {
            "name": "other_prefix",
            "dropped": 0,
            "partitions": 3,
            "max_payload": 1024 * 1024,
            "prefix": "acme.kvc",
            "records": framing_records()[:3],
        },
    ]


def framing() -> dict[str, Any]:
    messages = []
    for case in message_cases():
        prefix = case.get("prefix", wire.SUBJECT_PREFIX)
        limit = wire.message_limit(case["max_payload"])
        made = wire.messages_of(BATCH_ID, "gw-1", case["records"], case["partitions"], prefix, limit)
        sent, never = wire.publishable(made, case["max_payload"], case["dropped"])
        shown = [
            {
                "subject": m.subject,
                "headers": m.headers,
                "payload": m.payload.decode("ascii"),
                "first_record": m.first,
            }
            for m in sent
        ]
        dropped = [{"first_record": m.first, "records": int(m.headers[wire.RECORDS_HEADER])} for m in never]
        messages.append(
            {**case, "prefix": prefix, "batch_id": BATCH_ID, "gateway": "gw-1", "messages": shown,
             "never_published": dropped}
        )  # fmt: skip
    records = framing_records()
    encoded = [wire.encode(r) for r in records]
    return {
        "version": wire.VERSION,
        "seconds": [{"value": v, "text": wire.seconds_text(v)} for v in SECONDS],
        "strings": [{"value": v, "json": wire.encode(v).decode("ascii")} for v in STRINGS],
        "bodies": [
            {
                "batch_id": BATCH_ID,
                "gateway": "gw-1",
                "dropped": 0,
                "records": records[:2],
                "body": wire.batch_body(BATCH_ID, "gw-1", 0, encoded[:2]).decode("ascii"),
            },
            {
                "batch_id": BATCH_ID,
                "gateway": "gw-1",
                "dropped": 1000000,
                "records": [],
                "body": wire.batch_body(BATCH_ID, "gw-1", 10**6, []).decode("ascii"),
            },
        ],
        "part_ids": [
            {"batch_id": b, "half": h, "id": wire.part_id(b, h)}
            for b in (BATCH_ID, wire.part_id(BATCH_ID, 0))
            for h in (0, 1)
        ],
        "messages": messages,
        "names": [{"value": n, "name": wire.printable_name(n)} for n in NAMES],
        "markers": [
            {"text": t, "markers": [m.group(0) for m in wire.MARKER_RE.finditer(t)]} for t in MARKER_TEXTS
        ],
    }


FILES = {"golden.json": golden, "unicode.json": unicode, "exchanges.json": exchanges, "framing.json": framing}
