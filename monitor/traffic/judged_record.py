"""A gateway record as the judge reads it: frozen msgspec structs, decoded straight from the wire.

The fields and bounds are those of the documented wire models (``schema.py``); msgspec is never laxer
than pydantic, and what msgspec leaves to pydantic (a key hash's hex, a refused 2xx, a NUL in a
name) is pydantic's to name. A record's names (``NAMES``) are made printable on reading, by the
protocol's rule (``kvcanary.wire.printable_name``).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from kvcanary.monitor.traffic.schema import TrafficRecordWire
from kvcanary.wire import (
    MARKER_PATTERN,
    MAX_COUNT,
    MAX_FINGERPRINTS,
    MAX_INCIDENT_ID,
    MAX_MARKERS,
    MAX_MESSAGES,
    MAX_SECONDS,
    MAX_TIME,
    MAX_TOKENS,
    NAME_CHARS,
    CallerKind,
    RefusedBy,
    printable_name,
)
from kvcanary.wire import PRINT_END as FINGERPRINT_END

#: The record's fields a client names things by: shown to people, so made printable on reading.
NAMES = ("id", "upstream_id", "caller", "api_base", "model", "model_group", "finish_reason")
_T = TypeVar("_T")

# Python's re.search, so anchored with ``\Z``; ASCII classes only (pydantic's Rust regex folds case
# by Unicode: a Kelvin sign reads as a K there, and is left to pydantic here). No NUL in a name:
# decoded() refuses a body holding one, and pydantic names it (``schema.py``).
_Name = Annotated[str, Meta(max_length=NAME_CHARS)]
_Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
_Seconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
_Prints = Annotated[list[Annotated[int, Meta(ge=0, lt=FINGERPRINT_END)]], Meta(max_length=MAX_FINGERPRINTS)]
_Tokens = Annotated[list[Annotated[int, Meta(ge=1, lt=FINGERPRINT_END)]], Meta(max_length=MAX_TOKENS)]
_Marker = Annotated[str, Meta(pattern=f"^{MARKER_PATTERN}\\Z")]


class _Struct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A judged record's part: immutable, no field the wire lacks, and (holding no references
    back) not tracked by the cycle collector, which a window of them would slow."""


class PromptSize(_Struct, frozen=True):
    chars: _Count = 0
    bytes: _Count = 0
    messages: Annotated[int, Meta(ge=0, le=MAX_MESSAGES)] = 0


class Usage(_Struct, frozen=True):
    prompt_tokens: _Count | None = None
    completion_tokens: _Count | None = None
    cached_tokens: _Count | None = None


class Fingerprints(_Struct, frozen=True):
    prompt: _Prints = []
    response: _Prints = []


class Distinctive(_Struct, frozen=True):
    prompt: _Tokens = []
    response: _Tokens = []


class Refused(_Struct, frozen=True):
    by: RefusedBy
    tokens: _Count | None = None
    kv_pool_tokens: _Count | None = None
    incident_id: Annotated[int, Meta(ge=0, le=MAX_INCIDENT_ID)] | None = None


class TrafficRecord(_Struct, frozen=True, kw_only=True):
    """One request as the gateway saw it, as the judge reads it: the fields of
    :class:`TrafficRecordWire`. Made by ``reading.read_batch`` or :meth:`model_validate`
    (constructing one validates nothing); ``model_validate``, ``model_validate_json`` and
    ``model_dump`` are the pydantic model's, kept for the callers that read and write records."""

    id: _Name
    upstream_id: _Name | None = None
    time: Annotated[float, Meta(ge=0, le=MAX_TIME)]
    caller: _Name = ""
    caller_kind: CallerKind = "unknown"
    key_hash: Annotated[str, Meta(max_length=64)] = ""  # 64 hex digits or none: _fits
    api_base: _Name
    model: _Name = ""
    model_group: _Name = ""
    stream: bool = False
    status: Annotated[int, Meta(ge=100, le=599)]
    finish_reason: _Name | None = None
    latency_seconds: _Seconds | None = None
    ttft_seconds: _Seconds | None = None
    prompt: PromptSize = PromptSize()
    response_chars: _Count = 0
    usage: Usage = Usage()
    markers: Annotated[list[_Marker], Meta(max_length=MAX_MARKERS)] = []
    fingerprints: Fingerprints = Fingerprints()
    distinctive: Distinctive = Distinctive()
    truncated: bool = False
    refused: Refused | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def upstream(self) -> str:
        """Return the gateway's id of the response ("": it gave none): ``upstream_id``, or for an
        older tap's record, which carries none, its ``id``. Data only: two records may share it."""
        return self.id if self.upstream_id is None else self.upstream_id

    @classmethod
    def model_validate(cls, obj: Any) -> TrafficRecord:
        """Validate ``obj`` as the wire does; raise pydantic's ValidationError naming the field."""
        return from_wire(TrafficRecordWire.model_validate(obj))

    @classmethod
    def model_validate_json(cls, data: bytes | bytearray | str) -> TrafficRecord:
        """Read one record's JSON (msgspec where it takes it, else pydantic, which names the field)."""
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        record = decoded(RECORD_DECODER, raw)
        if record is None or not fits([record]):
            return from_wire(TrafficRecordWire.model_validate_json(data))
        return record

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """Every field, nested ones as dicts (the same in either mode: a record holds no dates)."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


RECORD_DECODER = msgspec.json.Decoder(TrafficRecord)
#: How JSON writes a NUL in a string (the only way: a raw one is malformed).
NUL_ESCAPE = b"\\u0000"
_HEX = "0123456789abcdef"


def decoded(decoder: msgspec.json.Decoder[_T], raw: bytes) -> _T | None:
    """``raw`` as msgspec reads it, or None where it refuses it or it holds a NUL escape."""
    if NUL_ESCAPE in raw:
        return None
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError:
        return None


def fits(records: list[TrafficRecord]) -> bool:
    """Whether every key hash is a SHA-256 in lowercase hex, or empty, and no refused record has a
    2xx status (what the decoder leaves to pydantic, which names the field)."""
    return all(
        (not r.key_hash or (len(r.key_hash) == 64 and not r.key_hash.strip(_HEX)))
        and (r.refused is None or not 200 <= r.status < 300)
        for r in records
    )


def from_wire(wire: TrafficRecordWire) -> TrafficRecord:
    """The struct of a record pydantic validated (nothing checked again), its names printable."""
    fields = dict(wire)
    fields["prompt"] = PromptSize(**dict(wire.prompt))
    fields["usage"] = Usage(**dict(wire.usage))
    fields["fingerprints"] = Fingerprints(**dict(wire.fingerprints))
    fields["distinctive"] = Distinctive(**dict(wire.distinctive))
    fields["refused"] = None if wire.refused is None else Refused(**dict(wire.refused))
    return printable(TrafficRecord(**fields))


def printable(record: TrafficRecord) -> TrafficRecord:
    """Return ``record`` with every name printable by the protocol's rule (``printable_name``, the
    tap's own): itself where they already are, the common case, else a copy with each made so."""
    names = {name: getattr(record, name) for name in NAMES}
    made = {name: printable_name(text) for name, text in names.items() if text is not None}
    if all(made[name] == names[name] for name in made):
        return record
    return msgspec.structs.replace(record, **made)
