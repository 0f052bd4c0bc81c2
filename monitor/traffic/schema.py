"""The wire of ``POST /api/v1/traffic``: a batch of per-request records from a gateway tap.

Every field is bounded, so a hostile or broken tap costs a 4xx naming the field and nothing else:
no string longer than a name, no list longer than the tap sends, no number out of range. The
envelope (:class:`TrafficBatch`) is validated first; then each record on its own
(:func:`valid_records`), so one bad record is refused, named, and costs none of the others. A record
carries no text: sizes, usage, timings, marker-shaped strings and keyed fingerprints
(``kvcanary/tap/record.py`` builds them).

The bounds are written twice, once for each of two readers of one body (``read_batch``):

- msgspec decodes a whole good body straight into :class:`TrafficRecord` structs (the common
  case: less than half of pydantic's CPU for ``bench/traffic.py``'s bodies, and a struct is
  cheaper to read in the judge and to keep);
- the pydantic models (``*Wire``) read any body msgspec refused, and are what names a bad field in
  a 422, what the API documents, and what :meth:`TrafficRecord.model_validate` validates with.

msgspec is written to be at least as strict as pydantic, never laxer (ASCII where pydantic's
regex folds Unicode case, no lax numbers or booleans, ``\\Z`` where Python's ``$`` passes a
trailing newline): a body it refuses is read again by pydantic, so what is accepted, refused and
named is pydantic's decision, as it was, and a body both accept reads the same
(``tests/monitor/test_traffic_wire.py`` holds them to that). Two bounds are checked beside the
decoder rather than by a regex in it (a regex costs a third of the decoding): no string may hold
a NUL, and JSON writes one only as the escape ``\\u0000`` (a raw one is malformed), so a body with
that escape anywhere goes to pydantic; and a key hash is 64 lowercase hex digits or empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from pydantic.json_schema import GenerateJsonSchema

MAX_RECORDS = 1000
#: Bytes a batch's body may take (a full batch of records with every fingerprint a side allows).
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_FINGERPRINTS = 1024
MAX_MARKERS = 32
NAME_CHARS = 200
MAX_COUNT = 10**12
MAX_MESSAGES = 100_000
MAX_SECONDS = 86_400 * 7
MAX_TIME = 2**33  # epoch seconds
FINGERPRINT_END = 2**53
CallerKind = Literal["team", "key_alias", "key_hash", "end_user", "unknown"]
_T = TypeVar("_T")

# --- what pydantic reads: the models the API documents and names refusals by ----------------------

Name = Annotated[str, StringConstraints(max_length=NAME_CHARS, pattern=r"^[^\x00]*$")]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Fingerprint = Annotated[int, Field(ge=0, lt=FINGERPRINT_END)]
Marker = Annotated[str, StringConstraints(pattern=r"^(?i:KVC-[0-9a-f]{8}-[0-9a-f]{32})$")]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PromptSizeWire(Wire, title="PromptSize"):
    chars: Count = 0
    bytes: Count = 0
    messages: Annotated[int, Field(ge=0, le=MAX_MESSAGES)] = 0


class UsageWire(Wire, title="Usage"):
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    cached_tokens: Count | None = None


class FingerprintsWire(Wire, title="Fingerprints"):
    prompt: Annotated[list[Fingerprint], Field(max_length=MAX_FINGERPRINTS)] = []
    response: Annotated[list[Fingerprint], Field(max_length=MAX_FINGERPRINTS)] = []


class TrafficRecordWire(Wire, title="TrafficRecord"):
    """One request as the gateway saw it."""

    id: Name
    time: Annotated[float, Field(ge=0, le=MAX_TIME)]  # epoch seconds the request started
    caller: Name = ""
    caller_kind: CallerKind = "unknown"
    key_hash: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{64})?$")] = ""  # a SHA-256, never a key
    api_base: Name
    model: Name = ""
    model_group: Name = ""
    stream: bool = False
    status: Annotated[int, Field(ge=100, le=599)]
    finish_reason: Name | None = None
    latency_seconds: Seconds | None = None
    ttft_seconds: Seconds | None = None
    prompt: PromptSizeWire = PromptSizeWire()
    response_chars: Count = 0
    usage: UsageWire = UsageWire()
    markers: Annotated[list[Marker], Field(max_length=MAX_MARKERS)] = []
    fingerprints: FingerprintsWire = FingerprintsWire()
    truncated: bool = False


BatchId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Gateway = Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.:-]*$")]


class TrafficBatch(Wire):
    """The envelope; its records are read one by one (:func:`valid_records`)."""

    #: The tap's id for this batch, the same when it sends it again (its answer lost): judged once.
    batch: BatchId | None = None
    gateway: Gateway = ""
    #: Records the tap dropped since its last accepted batch (the monitor was down or slow).
    dropped: Count = 0
    #: Anything, read one by one when the whole fails (valid_records): a ``null`` among them costs
    #: only itself, refused under its own index.
    records: Annotated[list[Any], Field(max_length=MAX_RECORDS)]


class _WholeBatch(TrafficBatch):
    records: Annotated[list[TrafficRecordWire], Field(max_length=MAX_RECORDS)]


class _PublicNames(GenerateJsonSchema):
    """Documents each wire model by the name the API and the code call it (``TrafficRecord``)."""

    def normalize_name(self, name: str) -> str:
        return super().normalize_name(name).removesuffix("Wire")


#: The body's JSON schema as the API documents it (each record in full).
BATCH_SCHEMA = _WholeBatch.model_json_schema(schema_generator=_PublicNames)

# --- what msgspec reads: the records the judge reads ----------------------------------------------

# Python's re.search, so anchored with ``\Z``; ASCII classes only (pydantic's Rust regex folds case
# by Unicode: a Kelvin sign reads as a K there, and is left to pydantic here). No NUL in a name:
# read_batch and model_validate_json look for one in the body (the module doc).
_Name = Annotated[str, Meta(max_length=NAME_CHARS)]
_Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
_Seconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
_Prints = Annotated[list[Annotated[int, Meta(ge=0, lt=FINGERPRINT_END)]], Meta(max_length=MAX_FINGERPRINTS)]
_Marker = Annotated[str, Meta(pattern=r"^[Kk][Vv][Cc]-[0-9A-Fa-f]{8}-[0-9A-Fa-f]{32}\Z")]


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


class TrafficRecord(_Struct, frozen=True, kw_only=True):
    """One request as the gateway saw it, as the judge reads it: the fields of
    :class:`TrafficRecordWire`. Made by :func:`read_batch` or :meth:`model_validate` (constructing
    one validates nothing); ``model_validate``, ``model_validate_json`` and ``model_dump`` are the
    pydantic model's, kept for the callers that read and write records with them."""

    id: _Name
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
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @classmethod
    def model_validate(cls, obj: Any) -> TrafficRecord:
        """Validate ``obj`` as the wire does; raise pydantic's ValidationError naming the field."""
        return _judged(TrafficRecordWire.model_validate(obj))

    @classmethod
    def model_validate_json(cls, data: bytes | bytearray | str) -> TrafficRecord:
        """Read one record's JSON (msgspec where it takes it, else pydantic, which names the field)."""
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        record = _decoded(_RECORD, raw)
        if record is None or not _fits([record]):
            return _judged(TrafficRecordWire.model_validate_json(data))
        return record

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """Every field, nested ones as dicts (the same in either mode: a record holds no dates)."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class _Batch(_Struct, frozen=True, kw_only=True):
    batch: Annotated[str, Meta(pattern=r"^[0-9a-f]{32}\Z")] | None = None
    gateway: Annotated[str, Meta(max_length=64, pattern=r"^[A-Za-z0-9_.:-]*\Z")] = ""
    dropped: _Count = 0
    records: Annotated[list[TrafficRecord], Meta(max_length=MAX_RECORDS)]


_BATCH = msgspec.json.Decoder(_Batch)
_RECORD = msgspec.json.Decoder(TrafficRecord)
#: How JSON writes a NUL in a string (the only way: a raw one is malformed).
NUL_ESCAPE = b"\\u0000"
_HEX = "0123456789abcdef"


def _decoded(decoder: msgspec.json.Decoder[_T], raw: bytes) -> _T | None:
    """``raw`` as msgspec reads it, or None where it refuses it or it holds a NUL escape."""
    if NUL_ESCAPE in raw:
        return None
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError:
        return None


def _fits(records: list[TrafficRecord]) -> bool:
    """Whether every key hash is a SHA-256 in lowercase hex, or empty (what the decoder leaves)."""
    return all(not r.key_hash or (len(r.key_hash) == 64 and not r.key_hash.strip(_HEX)) for r in records)


def _judged(wire: TrafficRecordWire) -> TrafficRecord:
    """The struct of a record pydantic validated (nothing checked again)."""
    fields = dict(wire)
    fields["prompt"] = PromptSize(**dict(wire.prompt))
    fields["usage"] = Usage(**dict(wire.usage))
    fields["fingerprints"] = Fingerprints(**dict(wire.fingerprints))
    return TrafficRecord(**fields)


@dataclass
class ValidRecords:
    records: list[TrafficRecord]
    #: Each refused record's errors, their ``loc`` starting ``("records", index)``.
    errors: list[dict[str, Any]]
    refused: int


def read_batch(body: bytes) -> tuple[TrafficBatch, ValidRecords]:
    """Return the envelope and its valid records. A whole good batch is read in one pass by
    msgspec (the common case); any other is read by pydantic, whole, then, where a record is bad,
    one record at a time. Raise ValidationError for a bad envelope."""
    whole = _decoded(_BATCH, body)
    if whole is None or not _fits(whole.records):
        return _read_by_pydantic(body)
    envelope = TrafficBatch.model_construct(
        batch=whole.batch, gateway=whole.gateway, dropped=whole.dropped, records=[]
    )
    return envelope, ValidRecords(whole.records, [], 0)


def _read_by_pydantic(body: bytes) -> tuple[TrafficBatch, ValidRecords]:
    try:
        whole = _WholeBatch.model_validate_json(body)
    except ValidationError:
        batch = TrafficBatch.model_validate_json(body)
        return batch, valid_records(batch)
    envelope = TrafficBatch.model_construct(
        batch=whole.batch, gateway=whole.gateway, dropped=whole.dropped, records=[]
    )
    return envelope, ValidRecords([_judged(r) for r in whole.records], [], 0)


def valid_records(batch: TrafficBatch) -> ValidRecords:
    """Validate each record of ``batch`` on its own: the good ones, and what was wrong with the rest."""
    good, errors, refused = [], [], 0
    for i, raw in enumerate(batch.records):
        try:
            good.append(TrafficRecord.model_validate(raw))
        except ValidationError as exc:
            refused += 1
            for error in exc.errors(include_url=False, include_input=False, include_context=False):
                errors.append({**error, "loc": ("records", i, *error["loc"])})
    return ValidRecords(good, errors, refused)
