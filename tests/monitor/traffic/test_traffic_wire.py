"""The two readers of a traffic body (``monitor/traffic/schema.py``) decide alike.

msgspec reads a whole good body; anything it refuses is read by pydantic, which names the bad
field. So every body must come out of :func:`read_batch` exactly as it comes out of pydantic alone
(accepted, refused, the same records, the same errors by the same index): msgspec may refuse what
pydantic takes (it is read again), never take what pydantic refuses. Each bound is tried at its
edge, on both sides of it, and then at random.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvcanary import wire
from kvcanary.monitor.traffic import reading as body_reading
from kvcanary.monitor.traffic import schema
from kvcanary.monitor.traffic.judged_record import RECORD_DECODER, TrafficRecord, decoded, fits
from kvcanary.monitor.traffic.reading import read_batch
from kvcanary.monitor.traffic.schema import BATCH_SCHEMA, TrafficRecordWire

HASH = "ab" * 32
MARKER = "KVC-0123abcd-" + "0" * 32
#: A body's head, written by hand: the protocol's version, then the records.
V4 = b'{"version": 4, "records": ['


def record(**fields: Any) -> dict[str, Any]:
    base = {"id": "r-1", "time": 1.8e9, "caller": "acme", "caller_kind": "team", "api_base": "http://x/v1",
            "status": 200, "prompt": {"chars": 10, "bytes": 10, "messages": 1}, "key_hash": HASH,
            "usage": {"prompt_tokens": 3}, "markers": [MARKER],
            "fingerprints": {"prompt": [1, 2**53 - 1], "response": [0, 5]}}  # fmt: skip
    return {**base, **fields}


def body(*records: Any, **envelope: Any) -> bytes:
    batch = {"version": wire.VERSION, "gateway": "gw-1", "records": list(records), **envelope}
    return json.dumps(batch).encode()


def reading(read: Any, raw: bytes) -> tuple[Any, ...]:
    """What a reader made of ``raw``, comparable across readers."""
    try:
        envelope, valid = read(raw)
    except ValidationError as exc:
        return ("refused", exc.errors(include_url=False))
    records = [r.model_dump() for r in valid.records]
    return envelope.batch, envelope.gateway, envelope.dropped, records, valid.errors, valid.refused


def fast_reader_takes(raw: bytes) -> bool:
    """Whether msgspec reads ``raw`` alone: its envelope, and each of its records."""
    try:
        envelope = body_reading._ENVELOPE.decode(raw)
    except msgspec.DecodeError:
        return False
    records = [decoded(RECORD_DECODER, bytes(r)) for r in envelope.records]
    return all(r is not None and fits([r]) for r in records)


def assert_read_alike(raw: bytes) -> None:
    assert reading(read_batch, raw) == reading(body_reading._read_by_pydantic, raw)


BAD_RECORDS = [
    *[{name: "x" * 201} for name in ("id", "caller", "api_base", "model", "model_group", "finish_reason")],
    *[{name: "a\x00b"} for name in ("id", "caller", "api_base", "model", "model_group", "finish_reason")],
    {"caller": "a" * 199 + "\U0001f600" * 2},  # 201 characters, more bytes
    {"key_hash": HASH + "\n"},  # Python's ``$`` would pass it
    {"key_hash": HASH.upper()},
    {"key_hash": HASH[:-1]},
    {"key_hash": "g" * 64},
    {"key_hash": "sk-a-raw-key-0123"},
    {"markers": [MARKER] * 33},
    {"markers": [MARKER + "\n"]},
    {"markers": ["not a marker"]},
    {"markers": ["\u212avc-0123abcd-" + "0" * 32]},  # a Kelvin sign is no K: no marker (pydantic folded it)
    {"markers": ["\uff2b\uff36\uff23-0123abcd-" + "0" * 32]},  # fullwidth letters
    {"status": 99},
    {"status": 600},
    {"status": True},
    {"time": -1},
    {"time": 2**33 + 1},
    {"latency_seconds": 86_400 * 7 + 0.5},
    {"ttft_seconds": -0.1},
    {"response_chars": -1},
    {"response_chars": 10**12 + 1},
    {"caller_kind": "admin"},
    {"stream": "maybe"},
    {"prompt": {"chars": -1}},
    {"prompt": {"messages": 100_001}},
    {"prompt": {"chars": "many"}},
    {"prompt": {"chars": 1, "text": "words"}},
    {"usage": {"prompt_tokens": -1}},
    {"usage": {"cached": 1}},
    {"fingerprints": {"prompt": [2**53]}},
    {"fingerprints": {"response": [-1]}},
    {"fingerprints": {"response": list(range(1025))}},
    {"fingerprints": {"prompt": "1,2"}},
    {"fingerprints": {"prompt": [1], "words": ["a"]}},
    {"text": "a customer's words"},
    # What the wire says is an integer or a boolean is one: no string, no boolean for a number.
    {"status": "204"},
    {"stream": 1},
    {"stream": "yes"},
    {"status": 503, "refused": {"by": "quarantine", "incident_id": True}},
]


@pytest.mark.parametrize("change", BAD_RECORDS, ids=lambda c: ",".join(c)[:40])
def test_each_bound_is_refused_by_the_fast_reader_and_named_by_pydantic(change: dict[str, Any]) -> None:
    raw = body(record(), record(**{"id": "r-2", **change}))
    assert not fast_reader_takes(raw)
    assert_read_alike(raw)
    _, valid = read_batch(raw)
    assert valid.refused == 1 and [r.id for r in valid.records] == ["r-1"]
    assert {e["loc"][:2] for e in valid.errors} == {("records", 1)}


@pytest.mark.parametrize(
    "raw",
    [
        body(*[record(id=f"r-{i}") for i in range(1001)]),
        body(record(), gateway="g" * 65),
        body(record(), gateway="bad gateway!"),
        body(record(), batch="AB" * 16),
        body(record(), batch="ab" * 16 + "\n"),
        body(record(), dropped=-1),
        body(record(), dropped=10**6 + 1),  # one body cannot claim more drops than a tap's queue held
        body(record(), pad="x"),
        V4 + json.dumps(record()).encode()[:-1] + b', "model": "m\\ud800"}]}',  # lone surrogate
        V4 + json.dumps(record()).encode()[:-1] + b', "model": "m\xff"}]}',  # not UTF-8
        body(record()) + b" x",
        b"\xef\xbb\xbf" + body(record()),
        b"[]",
        b"{not json",
    ],
    ids=range(14),
)
def test_a_bad_envelope_or_body_is_refused_whole_as_pydantic_refuses_it(raw: bytes) -> None:
    assert not fast_reader_takes(raw)
    assert_read_alike(raw)
    with pytest.raises(ValidationError):
        read_batch(raw)


@pytest.mark.parametrize(
    "raw",
    [
        body(record(caller="\U0001f600" * 200, finish_reason="x" * 200)),  # at the bound
        body(record(key_hash="", markers=[], fingerprints={})),
        body(record(markers=["kvc-0123ABCD-" + "F" * 32])),  # a marker in any case
        body(record(status=200.0)),  # a number with no fraction: the integer JSON Schema says it is
        body(record(caller="a\\u0000b")),  # a backslash, not a NUL
        V4 + json.dumps(record()).encode()[:-1] + b', "status": 99, "status": 201}]}',
        V4 + json.dumps(record()).encode()[:-1] + b', "model": "\\ud83d\\ude00"}]}',
        body(
            record(time=0, latency_seconds=86_400 * 7, response_chars=10**12), dropped=10**6, batch="0" * 32
        ),
    ],
    ids=range(8),
)
def test_an_odd_good_body_is_read_as_pydantic_reads_it(raw: bytes) -> None:
    assert_read_alike(raw)
    _, valid = read_batch(raw)
    assert valid.refused == 0 and len(valid.records) == 1


def test_json_that_pydantic_reads_and_msgspec_does_not_is_read_as_pydantic_reads_it() -> None:
    raw = V4 + json.dumps(record()).encode() + b", NaN]}"
    assert not fast_reader_takes(raw)
    assert_read_alike(raw)
    assert read_batch(raw)[1].refused == 1  # the NaN, under its index; the record beside it taken


def test_a_duplicated_key_is_read_by_its_last_value_or_refused_by_it() -> None:
    head = json.dumps(record()).encode()[:-1]
    raw = V4 + head + b', "status": 201, "status": 99}]}'
    assert not fast_reader_takes(raw)
    assert_read_alike(raw)
    assert read_batch(raw)[1].refused == 1


NAMES = st.one_of(
    st.text(max_size=3), st.text(min_size=199, max_size=202), st.sampled_from(["a\x00", "\n", "\u212a"])
)
PROMPT = {
    "chars": st.sampled_from([0, -1, 10**12, 10**12 + 1]),
    "messages": st.sampled_from([0, 100_000, 100_001]),
    "words": st.just(1),
}
PRINTS = {
    "prompt": st.lists(st.sampled_from([0, 1, 2**53 - 1, 2**53, -1]), max_size=3),
    "response": st.lists(st.integers(0, 9), min_size=1020, max_size=1030),
}
#: Each field's values: good ones, ones at a bound, and ones past it.
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "id": NAMES,
    "caller": NAMES,
    "caller_kind": st.sampled_from(["team", "end_user", "unknown", "admin", ""]),
    "key_hash": st.sampled_from(["", HASH, HASH + "\n", HASH.upper(), "ab"]),
    "status": st.sampled_from([99, 100, 200, 599, 600, 200.0, 200.5, "200", True, None]),
    "time": st.sampled_from([0, -1, 1.8e9, 2**33, 2**33 + 1, "1"]),
    "latency_seconds": st.sampled_from([None, 0.0, 604_800, 604_800.5, -0.0, "x"]),
    "stream": st.sampled_from([True, False, 0, 1, 2, "true", None]),
    "response_chars": st.sampled_from([0, 10**12, 10**12 + 1, -1, 1.0]),
    "prompt": st.fixed_dictionaries({}, optional=PROMPT),
    "usage": st.fixed_dictionaries({}, optional={"prompt_tokens": st.sampled_from([None, 0, -1, 5])}),
    "markers": st.lists(st.sampled_from([MARKER, MARKER.lower(), MARKER + "\n", "KVC-1"]), max_size=34),
    "fingerprints": st.fixed_dictionaries({}, optional=PRINTS),
    "extra": st.just("words"),
}


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    changed = draw(st.lists(st.sampled_from(sorted(VALUES)), unique=True))
    return record(**{name: draw(VALUES[name]) for name in changed})


@settings(max_examples=300, deadline=None)
@given(st.lists(records(), min_size=1, max_size=3))
def test_any_body_is_read_by_read_batch_as_by_pydantic_alone(drawn: list[dict[str, Any]]) -> None:
    assert_read_alike(body(*drawn))


def test_a_record_reads_alike_either_way_and_dumps_as_the_wire_does() -> None:
    raw = json.dumps(record(finish_reason="stop", latency_seconds=1, ttft_seconds=0.5)).encode()
    fast, wire = TrafficRecord.model_validate_json(raw), TrafficRecordWire.model_validate_json(raw)
    assert fast.model_dump(mode="json") == wire.model_dump(mode="json") == fast.model_dump()
    assert TrafficRecord.model_validate(json.loads(raw)) == fast
    assert TrafficRecord.model_validate_json(raw.decode()) == fast
    for bad in (record(caller="a\x00"), record(key_hash=HASH + "\n"), record(status=99)):
        with pytest.raises(ValidationError):
            TrafficRecord.model_validate_json(json.dumps(bad))


def test_the_judged_record_has_the_wire_records_fields_and_defaults() -> None:
    assert list(TrafficRecordWire.model_fields) == list(TrafficRecord.__struct_fields__)
    least = json.dumps({"id": "r", "time": 0, "api_base": "x", "status": 200})
    fast, wire = RECORD_DECODER.decode(least), TrafficRecordWire.model_validate_json(least)
    assert fast.model_dump() == wire.model_dump(mode="json")


def test_the_documented_schema_names_the_records_as_before() -> None:
    assert {"TrafficRecord", "PromptSize", "Usage", "Fingerprints"} <= set(BATCH_SCHEMA["$defs"])
    assert not [name for name in BATCH_SCHEMA["$defs"] if name.endswith("Wire")]


def test_a_good_body_is_read_by_msgspec_and_an_odd_one_by_pydantic() -> None:
    assert fast_reader_takes(body(record(), record(id="r-2", key_hash="", markers=[MARKER.lower()])))
    assert not fast_reader_takes(body(record(status=200.0)))  # pydantic's to take
    assert type(read_batch(body(record()))[1].records[0]) is TrafficRecord
    assert type(read_batch(body(record(status=200.0)))[1].records[0]) is TrafficRecord


def largest_record() -> dict[str, Any]:
    """A valid record at every bound, each value the longest JSON can write it: 200-character names
    of characters written in 12 bytes (a surrogate pair), numbers at their most digits."""
    name = "\U0001f600" * schema.NAME_CHARS
    longest_float = 2.2250738585072014e-308  # 23 characters: no float in range writes longer
    most, prints, tokens = schema.MAX_COUNT, [schema.FINGERPRINT_END - 1], schema.MAX_TOKENS
    return {
        "id": name, "upstream_id": name, "time": longest_float, "caller": name, "caller_kind": "key_alias",
        "key_hash": HASH, "api_base": name, "model": name, "model_group": name, "stream": False,
        "status": 503, "finish_reason": name, "latency_seconds": longest_float, "ttft_seconds": longest_float,
        "prompt": {"chars": most, "bytes": most, "messages": schema.MAX_MESSAGES}, "response_chars": most,
        "usage": {"prompt_tokens": most, "completion_tokens": most, "cached_tokens": most},
        "markers": [MARKER] * schema.MAX_MARKERS,
        "fingerprints": {side: prints * schema.MAX_FINGERPRINTS for side in ("prompt", "response")},
        "distinctive": {"prompt": prints * tokens, "response": prints * tokens},
        "truncated": False,
        "refused": {"by": "quarantine", "tokens": most, "kv_pool_tokens": most, "incident_id": 2**63 - 1},
    }  # fmt: skip


def test_a_batch_at_every_bound_fits_the_body_cap_and_is_read_whole() -> None:
    largest = largest_record()
    compact = json.dumps(largest, separators=(",", ":")).encode()
    assert len(compact) == wire.MAX_RECORD_BYTES
    spaced = json.dumps(largest).encode()  # Python's default: a space after each comma and colon
    for encoded in (compact, spaced):
        envelope = {"version": 4, "batch": "0" * 32, "gateway": "g" * 64, "dropped": schema.MAX_DROPPED}
        head = json.dumps(envelope).encode()[:-1] + b', "records": ['
        raw = head + b", ".join([encoded] * schema.MAX_RECORDS) + b"]}"
        assert len(raw) <= schema.MAX_BODY_BYTES, f"{len(raw) / 2**20:.1f} MiB"
    _, valid = read_batch(raw)
    assert len(valid.records) == schema.MAX_RECORDS and valid.refused == 0
    assert valid.records[0].model_dump() == TrafficRecordWire.model_validate(largest).model_dump(mode="json")
