"""The tap protocol's rules that the gateway tap and the monitor both hold to, written once: its
version, the bounds of a record and of a batch, the marker pattern, the caller kinds, how a name
is made printable, how a record and a batch are written as bytes, how a batch is cut into NATS
messages, and the routing key and partition of a deployment (``docs/tap-protocol.md``, whose
golden vectors are ``tests/fixtures/wire/``). Standard library only: the tap imports it into a
gateway's process, and the monitor imports it too (never the other way: the tap imports nothing
of ``monitor/``). Nothing here imports nats-py: the framing of a message is bytes and headers.

The routing key is the one routing rule. The judge routes a record to a target by it
(``monitor/traffic/judge.py``), the blast radius's DuckDB and PostgreSQL sources compare the keys
of logged ``api_base`` values with it (``monitor/routing.py`` writes the same rule as SQL), and
the tap's JetStream sink hashes it into a partition:

1. strip the surrounding ``BLANKS`` (ASCII whitespace only);
2. lower-case the whole URL (scheme, host and path), ASCII letters only (``A``-``Z``: a non-ASCII
   letter is left as it is, since Python, PostgreSQL, DuckDB, Go and Rust lower-case those
   differently);
3. strip trailing slashes, then one trailing ``/v1``, then trailing slashes again.

``partition_of`` is CRC-32 (IEEE) of the key's UTF-8 bytes modulo the partition count. A change of
either moves deployments between partitions, so taps and monitors change it together, as a new
protocol version.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import string
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, get_args

#: The tap protocol's version: in every batch (``version``) and on every NATS message
#: (``VERSION_HEADER``). The monitor judges the versions it speaks and refuses the others, since
#: two versions print the same text differently and one deployment's window must hold one.
VERSION = 4
SPOKEN_VERSIONS = (VERSION,)

#: JetStream: subjects are ``<SUBJECT_PREFIX>.<partition>``, over ``PARTITIONS`` by default, and a
#: message carries these headers beside its records (``docs/tap-protocol.md``).
SUBJECT_PREFIX = "kvcanary.traffic"
PARTITIONS = 16
VERSION_HEADER = "Kvcanary-Version"
GATEWAY_HEADER = "Kvcanary-Gateway"
DROPPED_HEADER = "Kvcanary-Dropped"
RECORDS_HEADER = "Kvcanary-Records"
MSG_ID_HEADER = "Nats-Msg-Id"
#: A message's payload is at most this many bytes, or the server's ``max_payload`` less
#: ``HEADER_BYTES`` where that is smaller; the headers are not counted in it.
MESSAGE_BYTES = 512 * 1024
HEADER_BYTES = 1024
#: The quarantine set in JetStream: the KV bucket the monitors put it in (their
#: ``traffic.jetstream.quarantine_bucket``, the taps' ``KVCANARY_TAP_QUARANTINE_BUCKET``) and its key.
QUARANTINE_BUCKET = "kvcanary_quarantine"
QUARANTINE_KEY = "set"
#: The quarantine set travels signed (``docs/tap-protocol.md``, "Quarantine"): a DSSE envelope of
#: this payload type, its Ed25519 signature over ``envelope_pae(type, payload)``, its key named by
#: ``key_id``. A tap on NATS acknowledges the set it holds on ``applied_subject(bucket, gateway)``.
QUARANTINE_PAYLOAD_TYPE = "application/vnd.kvcanary.quarantine+json"
APPLIED_TOKEN = "applied"
#: A gateway's name (``KVCANARY_TAP_GATEWAY``): a metric label, a header and a subject's tail.
GATEWAY_PATTERN = r"[A-Za-z0-9_.:-]{1,64}"
#: What a tap polling the quarantine set holds, sent with each read: ``<revision> <key id>``.
QUARANTINE_HELD_HEADER = "Kvcanary-Quarantine-Held"

# --- the bounds of a batch and of a record -------------------------------------------------------

#: Records one batch may report dropped (its ``dropped``): one input cannot move the monitor's drop
#: counter by more; a tap with more to report reports the rest with its next batches.
MAX_DROPPED = 10**6
#: Records one batch may carry.
MAX_RECORDS = 1000
#: Prints a side: n-gram fingerprints, and distinctive tokens' prints.
MAX_FINGERPRINTS = 1024
MAX_TOKENS = 256
#: Prints are below 2**53, exact in any JSON reader; a fingerprint may be 0 (``OWN``), a token's never.
PRINT_END = 2**53
MAX_MARKERS = 32
#: Code points of a name (ids, callers, deployments, models, a finish reason).
NAME_CHARS = 200
#: The largest count (sizes, tokens), message count, duration and time a record may hold.
MAX_COUNT = 10**12
MAX_MESSAGES = 100_000
MAX_SECONDS = 7 * 86_400
MAX_TIME = 2**33
MAX_INCIDENT_ID = 2**63 - 1
#: The most bytes a valid record takes written compactly (no white space, non-ASCII escaped, as
#: :func:`encode` writes it): every field at its bound, each name 200 characters that JSON writes
#: in 12 bytes, each number its longest in any JSON writer
#: (``tests/monitor/traffic/test_traffic_wire.py`` builds it).
MAX_RECORD_BYTES = 62_636
#: The most bytes a batch's body may take (``POST /api/v1/traffic`` answers 413 past it): a batch of
#: ``MAX_RECORDS`` records each of ``MAX_RECORD_BYTES`` is 59.7 MiB, and 62.3 MiB written with a
#: space after each comma and colon.
MAX_BODY_BYTES = 64 * 1024 * 1024

#: How many times denser than the densest text the monitor measured on a target (characters per
#: token) a prompt must seem before its size alone is taken as sure: the traffic tokens check calls a
#: count below it impossible, and the gateway's admission guard, with no count from the
#: deployment's tokenizer, refuses only a prompt over the pool at that density.
SURE_DENSITY_MARGIN = 8.0
#: The most UTF-8 bytes one token holds in any tokenizer kvcanary knows: OpenAI's cl100k and o200k
#: and DeepSeek's stop at 128 (runs of spaces), the vocabulary LiteLLM ships as Anthropic's has one
#: of 1,024. A count under a prompt's bytes over it (zero for any prompt) is no tokenizer's: the
#: admission guard takes it as no count, and the monitor a density denser than it as no calibration.
MAX_TOKEN_BYTES = 1024

CallerKind = Literal["team", "key_alias", "key_hash", "end_user", "unknown"]
CALLER_KINDS: tuple[CallerKind, ...] = get_args(CallerKind)
RefusedBy = Literal["admission", "quarantine"]
REFUSED_BY: tuple[RefusedBy, ...] = get_args(RefusedBy)
#: A kvcanary marker (``probes/markers.py``: ``KVC-<8 hex id>-<32 hex secret>``), ASCII letters in
#: either case and nothing else: a Kelvin sign or a fullwidth letter makes no marker.
MARKER_PATTERN = r"[Kk][Vv][Cc]-[0-9A-Fa-f]{8}-[0-9A-Fa-f]{32}"
MARKER_RE = re.compile(MARKER_PATTERN)

# --- names ---------------------------------------------------------------------------------------

#: Unicode's format characters (general category Cf, as of Unicode 17): bidi embeddings,
#: overrides and isolates, zero-width characters, the BOM, tags. Shown as U+FFFD in a name.
FORMAT_RANGES = (
    (0x00AD, 0x00AD), (0x0600, 0x0605), (0x061C, 0x061C), (0x06DD, 0x06DD), (0x070F, 0x070F),
    (0x0890, 0x0891), (0x08E2, 0x08E2), (0x180E, 0x180E), (0x200B, 0x200F), (0x202A, 0x202E),
    (0x2060, 0x2064), (0x2066, 0x206F), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB), (0x110BD, 0x110BD),
    (0x110CD, 0x110CD), (0x13430, 0x1343F), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001), (0xE0020, 0xE007F),
)  # fmt: skip
#: Private use (Co), and the surrogates (Cs: never a character; a JSON escape can make one).
PRIVATE_RANGES = ((0xD800, 0xDFFF), (0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))
#: Controls (C0, DEL, C1) and the line and paragraph separators: a space in a name.
BREAK_RANGES = ((0x0000, 0x001F), (0x007F, 0x009F), (0x2028, 0x2029))
#: White space a name's runs of are one space (Unicode's White_Space that is not a break above).
SPACE_RANGES = (
    (0x0020, 0x0020), (0x00A0, 0x00A0), (0x1680, 0x1680), (0x2000, 0x200A), (0x202F, 0x202F),
    (0x205F, 0x205F), (0x3000, 0x3000),
)  # fmt: skip


def char_class(ranges: Sequence[tuple[int, int]]) -> str:
    """Return a regular expression's character class body of ``ranges`` (inclusive code points)."""
    return "".join(
        re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges
    )


_BREAK_RE = re.compile(f"[{char_class(BREAK_RANGES)}]")
_HIDDEN_RE = re.compile(f"[{char_class(FORMAT_RANGES + PRIVATE_RANGES)}]")
_SPACES_RE = re.compile(f"[{char_class(SPACE_RANGES)}]+")


def printable_name(value: object) -> str:
    """Return ``value`` as a name a record may carry: printable, at most ``NAME_CHARS`` code points.

    A record's names reach incident titles, Alertmanager annotations, the incident page, CSV and
    terminals, and a customer writes some of them (an ``end_user``). The rule, the tap's and the
    monitor's alike (``docs/tap-protocol.md``, "Names"): take the first ``4 * NAME_CHARS`` code
    points; a break (``BREAK_RANGES``: it could start an escape sequence or a fake new line) becomes
    a space; a format character, a surrogate or a private-use character (``FORMAT_RANGES``,
    ``PRIVATE_RANGES``: they reorder or hide text) becomes U+FFFD, so that tampering shows; each run
    of white space (``SPACE_RANGES``) becomes one space; the ends are trimmed; the first
    ``NAME_CHARS`` code points are kept, and a space that ends them dropped. A name the rule keeps
    as it is is sent as it is: the rule applied twice changes nothing."""
    name = str(value or "")[: 4 * NAME_CHARS]
    if name.isascii() and name.isprintable() and "  " not in name and name.strip(" ") == name:
        return name[:NAME_CHARS].rstrip(" ")  # the common case: nothing to change
    name = _SPACES_RE.sub(" ", _HIDDEN_RE.sub("\ufffd", _BREAK_RE.sub(" ", name))).strip(" ")
    return name[:NAME_CHARS].rstrip(" ")


# --- bytes: a record, a batch, a message ---------------------------------------------------------


def seconds_text(value: float) -> str:
    """Return how the wire writes a duration or a time in seconds: rounded to the microsecond as
    ``floor(value * 1e6 + 0.5)`` in double arithmetic (each step rounded, no fused multiply-add),
    in decimal with one to six fraction digits and no trailing zero past the first:
    ``1733400000.25``, ``0.0``, ``12.000001``."""
    if not math.isfinite(value):
        raise ValueError(f"not a number of seconds: {value!r}")
    micros = math.floor(value * 1e6 + 0.5)
    whole, fraction = divmod(abs(micros), 1_000_000)
    digits = f"{fraction:06d}".rstrip("0") or "0"
    return f"{'-' if micros < 0 else ''}{whole}.{digits}"


def _text(value: str) -> str:
    # ensure_ascii: every code point past U+007E as \\uXXXX in lower-case hex (two escapes, a
    # surrogate pair, past U+FFFF); a surrogate, which no text holds, as U+FFFD.
    if not value.isascii():
        value = _SURROGATE_RE.sub("\ufffd", value)
    return json.dumps(value)


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _written(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return seconds_text(value)
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{_text(str(k))}:{_written(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        if all(type(v) is int for v in value):  # prints: the bulk of a record
            return "[" + ",".join(map(str, value)) + "]"
        return "[" + ",".join(map(_written, value)) + "]"
    raise TypeError(f"the wire has no {type(value).__name__}")


def encode(value: Any) -> bytes:
    """Return ``value`` (a record, or any part of one) as the wire writes it: JSON with no white
    space, an object's keys in their order, strings ASCII-only (``json.dumps``'s escapes), an
    integer in decimal, a float by :func:`seconds_text` (the record's floats are seconds)."""
    return _written(value).encode("ascii")


def batch_body(batch_id: str, gateway: str, dropped: int, records: Sequence[bytes]) -> bytes:
    """Return the body of ``POST /api/v1/traffic`` for records already written (:func:`encode`):
    ``{"version":4,"batch":...,"gateway":...,"dropped":...,"records":[...]}``."""
    head = f'{{"version":{VERSION},"batch":{_text(batch_id)},"gateway":{_text(gateway)},"dropped":{dropped}'
    return head.encode("ascii") + b',"records":[' + b",".join(records) + b"]}"


def part_id(batch_id: str, half: int) -> str:
    """Return the id of half ``half`` (0, 1) of a batch the monitor refused as too large (413):
    BLAKE2b (unkeyed, 16-byte digest) of ``<batch id>.<half>``, in hex, the same on every try."""
    return hashlib.blake2b(f"{batch_id}.{half}".encode(), digest_size=16).hexdigest()


class Message(NamedTuple):
    """One NATS message of a batch: its subject, payload and headers, and the index in the batch
    of its first record."""

    subject: str
    payload: bytes
    headers: dict[str, str]
    first: int


#: What a message's records are wrapped in: the HTTP body's records, ``{"records":[...]}``.
_OPEN, _CLOSE = b'{"records":[', b"]}"


def header_bytes(headers: Mapping[str, str]) -> int:
    """Return what ``headers`` take of a message as a NATS server counts them (``NATS/1.0`` and a
    line each), and room for ``Kvcanary-Dropped``, which only the first message published carries."""
    return 12 + sum(len(k) + len(v) + 4 for k, v in headers.items()) + len(DROPPED_HEADER) + 16


def subject_of(api_base: str, partitions: int, prefix: str = SUBJECT_PREFIX) -> str:
    """Return the subject a record of ``api_base`` is published on: ``<prefix>.<partition>``."""
    return f"{prefix}.{partition_of(api_base, partitions)}"


def message_limit(max_payload: int) -> int:
    """Return the most bytes a message's payload may take on a server of ``max_payload``."""
    return max(1, min(MESSAGE_BYTES, max_payload - HEADER_BYTES))


def messages_of(
    batch_id: str,
    gateway: str,
    records: Sequence[Mapping[str, Any]],
    partitions: int,
    prefix: str = SUBJECT_PREFIX,
    limit: int = MESSAGE_BYTES,
    encoded: Sequence[bytes] | None = None,
) -> list[Message]:
    """Return a batch's records as NATS messages: a partition's records together, in batch order,
    partitions in the order their first record comes, each payload ``{"records":[...]}`` of at most
    ``limit`` bytes (a record whose payload alone is larger goes as a message of its own), with
    the headers ``Kvcanary-Version``, ``Kvcanary-Gateway``, ``Kvcanary-Records`` and
    ``Nats-Msg-Id: <batch id>.<partition>.<part>``. ``encoded``: the records already written."""
    written = list(encoded) if encoded is not None else [encode(r) for r in records]
    by_subject: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        by_subject.setdefault(subject_of(str(record.get("api_base", "")), partitions, prefix), []).append(i)
    out: list[Message] = []
    for subject, indexes in by_subject.items():
        partition = subject.rsplit(".", 1)[1]
        for part, chunk in enumerate(_chunks([written[i] for i in indexes], limit)):
            first = indexes[chunk[0]]
            headers = {
                VERSION_HEADER: str(VERSION),
                GATEWAY_HEADER: gateway,
                RECORDS_HEADER: str(len(chunk)),
                MSG_ID_HEADER: f"{batch_id}.{partition}.{part}",
            }
            payload = _OPEN + b",".join(written[indexes[j]] for j in chunk) + _CLOSE
            out.append(Message(subject, payload, headers, first))
    return out


def _chunks(encoded: list[bytes], limit: int) -> list[list[int]]:
    """Cut a partition's written records into runs (their indexes) whose payload is at most
    ``limit`` bytes, the wrapper and commas counted (a record over it alone goes as one)."""
    chunks: list[list[int]] = [[]]
    empty = len(_OPEN) + len(_CLOSE)
    size = empty
    for i, item in enumerate(encoded):
        if chunks[-1] and size + 1 + len(item) > limit:
            chunks.append([])
            size = empty
        size += (1 if chunks[-1] else 0) + len(item)
        chunks[-1].append(i)
    return chunks


def publishable(
    messages: list[Message], max_payload: int, dropped: int
) -> tuple[list[Message], list[Message]]:
    """Split ``messages`` into those a server of ``max_payload`` takes (their payload and headers
    within it) and those it never will (a record alone too large: dropped and counted), and put
    the batch's drop report (``dropped``, when not 0) on the first message it takes."""
    fits = [m for m in messages if len(m.payload) + header_bytes(m.headers) <= max_payload]
    never = [m for m in messages if len(m.payload) + header_bytes(m.headers) > max_payload]
    if fits and dropped:
        fits[0].headers[DROPPED_HEADER] = str(dropped)
    return fits, never


# --- routing, and the quarantine set's signature -------------------------------------------------

#: The characters stripped around an ``api_base`` (ASCII whitespace; not Python's wider ``strip()``).
BLANKS = " \t\n\v\f\r"
#: The path suffix of an OpenAI-compatible API, stripped once after trailing slashes.
API_SUFFIX = "/v1"
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def api_base_key(url: str) -> str:
    """Return the form routes compare (see the module doc): ``" HTTP://Host:8000/Prefix/V1/ "`` and
    ``"http://host:8000/prefix"`` have the same key, ``"http://host:8000/prefix"``."""
    key = url.strip(BLANKS).translate(_ASCII_LOWER).rstrip("/")
    if key.endswith(API_SUFFIX):
        key = key[: -len(API_SUFFIX)].rstrip("/")
    return key


def partition_of(api_base: str, partitions: int) -> int:
    """Return the partition of a deployment: CRC-32 of its key modulo ``partitions`` (the same in
    every tap process and language, unlike Python's salted ``hash``)."""
    # A surrogate (a JSON escape can make one) is hashed as U+FFFD, as every text's is.
    key = api_base_key(api_base)
    if not key.isascii():
        key = _SURROGATE_RE.sub("\ufffd", key)
    return zlib.crc32(key.encode("utf-8")) % partitions


def envelope_pae(payload_type: str, payload: bytes) -> bytes:
    """Return the bytes a quarantine set's signature covers: DSSE v1's pre-authentication encoding,
    ``DSSEv1 <len(type)> <type> <len(payload)> <payload>`` (lengths in ASCII decimal bytes, one
    space between parts), so that the payload is signed exactly as sent, never re-encoded."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def key_id(public_key: bytes) -> str:
    """Return the id of an Ed25519 public key (its 32 raw bytes): the first 16 hex digits of their
    SHA-256, what an envelope's signature names and the logs show."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def applied_subject(bucket: str, gateway: str) -> str:
    """Return the subject a tap watching ``bucket`` acknowledges the set it holds on:
    ``<bucket>.applied.<gateway>`` (the monitors listen on ``<bucket>.applied.>``)."""
    return f"{bucket}.{APPLIED_TOKEN}.{gateway}"
