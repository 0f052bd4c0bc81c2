"""What the gateway tap and the monitor must compute alike: a deployment's ``api_base`` key and its
partition, and the bounds both hold a batch to (its records, drops and bytes). Standard library
only: the tap imports it into a gateway's process, and the monitor imports it too (never the other
way: the tap imports nothing of ``monitor/``).

The key is the one routing rule. The judge routes a record to a target by it
(``monitor/traffic/judge.py``), the blast radius's DuckDB and PostgreSQL sources compare the keys
of logged ``api_base`` values with it (``monitor/blast/routing.py`` writes the same rule as SQL), and
the tap's JetStream sink hashes it into a partition. A tap in another language implements these
two functions byte for byte:

1. strip the surrounding ``BLANKS`` (ASCII whitespace only);
2. lower-case the whole URL, ASCII letters only (``A``-``Z``: a non-ASCII letter is left as it is,
   since Python, PostgreSQL, DuckDB, Go and Rust lower-case those differently);
3. strip trailing slashes, then one trailing ``/v1``, then trailing slashes again.

``partition_of`` is CRC-32 (IEEE) of the key's UTF-8 bytes modulo the partition count.

Changed (issue 32): the key used to lower-case the scheme and host only, while the blast radius's
SQL lower-cased the whole URL, so a gateway that spelled a path in another case was unmatched by the
judge but counted in the blast radius. The whole URL is lower-cased now: a deployment whose
``api_base`` has upper-case letters in its path hashes to a different partition than before, so
taps and monitors must be upgraded together (records of such a deployment published by an older tap
land on the partition the older rule chose, which another monitor replica may own).
"""

from __future__ import annotations

import hashlib
import string
import zlib

#: JetStream: subjects are ``<SUBJECT_PREFIX>.<partition>``, over ``PARTITIONS`` by default, and a
#: message carries these headers beside its records (``docs/tap-protocol.md``).
SUBJECT_PREFIX = "kvcanary.traffic"
PARTITIONS = 16
#: The quarantine set in JetStream: the KV bucket the monitors put it in (their
#: ``traffic.jetstream.quarantine_bucket``, the taps' ``KVCANARY_TAP_QUARANTINE_BUCKET``) and its key.
QUARANTINE_BUCKET = "kvcanary_quarantine"
QUARANTINE_KEY = "set"
#: The quarantine set travels signed (``docs/tap-protocol.md``, "Quarantine"): a DSSE envelope of
#: this payload type, its Ed25519 signature over ``envelope_pae(type, payload)``, its key named by
#: ``key_id``. A tap on NATS acknowledges the set it holds on ``applied_subject(bucket, gateway)``.
QUARANTINE_PAYLOAD_TYPE = "application/vnd.kvcanary.quarantine+json"
APPLIED_TOKEN = "applied"
GATEWAY_HEADER = "Kvcanary-Gateway"
#: A gateway's name (``KVCANARY_TAP_GATEWAY``): a metric label, a header and a subject's tail.
GATEWAY_PATTERN = r"[A-Za-z0-9_.:-]{1,64}"
#: What a tap polling the quarantine set holds, sent with each read: ``<revision> <key id>``.
QUARANTINE_HELD_HEADER = "Kvcanary-Quarantine-Held"
DROPPED_HEADER = "Kvcanary-Dropped"
RECORDS_HEADER = "Kvcanary-Records"
#: Records one batch may report dropped (its ``dropped``): one input cannot move the monitor's drop
#: counter by more; a tap with more to report reports the rest with its next batches.
MAX_DROPPED = 10**6
#: Records one batch may carry.
MAX_RECORDS = 1000
#: The most bytes a valid record takes written compactly (``json.dumps(record, separators=(",",
#: ":"))``, non-ASCII escaped): every field at its bound, each name 200 characters that JSON writes
#: in 12 bytes, each number its longest (``tests/monitor/traffic/test_traffic_wire.py`` builds it).
MAX_RECORD_BYTES = 62_636
#: The most bytes a batch's body may take (``POST /api/v1/traffic`` answers 413 past it): a batch of
#: ``MAX_RECORDS`` records each of ``MAX_RECORD_BYTES`` is 59.7 MiB, and 62.3 MiB written with a
#: space after each comma and colon (Python's ``json.dumps`` by default).
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
    # A lone surrogate (a JSON escape can make one) is hashed as its code point, never raised on.
    return zlib.crc32(api_base_key(api_base).encode("utf-8", "surrogatepass")) % partitions


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
