"""The wire of ``POST /api/v1/traffic`` as the monitor reads it: a batch of per-request records
from a gateway tap, every field bounded.

A hostile or broken tap costs a 4xx naming the field and nothing else. The envelope
(:class:`TrafficBatch`) is validated first, then each record on its own (:func:`valid_records`), so
one bad record is refused, named, and costs none of the others. A record carries no text
(``kvcanary/tap/record.py`` builds it); its bounds, caller kinds and marker pattern are the
protocol's, stated once in ``kvcanary/wire.py`` for the tap and the monitor alike. A batch of a
tap protocol version this monitor does not speak, or of none, is refused whole
(:class:`UnspokenVersion`) and counted (``monitor/metrics/versions.py``), never judged: two versions
print the same text differently, and one deployment's fingerprint window must hold one.

The bounds are written twice, for two readers of one body (``read_batch``): msgspec decodes each
good record straight into a :class:`TrafficRecord`, and the pydantic models (``*Wire``) read what
msgspec refused, name the bad field in a 422 and are what the API documents. msgspec is never laxer
than pydantic, so what is accepted and refused is pydantic's decision. How the two are kept alike,
what a refusal may cost, and why a record's identity is its ``id`` and never the engine's:
``docs/architecture.md``, "Gateway traffic". A record's names (``NAMES``) are made printable on
reading, by the protocol's rule (``kvcanary.wire.printable_name``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    FailFast,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import from_json

from kvcanary.probes.untrusted import plain
from kvcanary.wire import (
    MARKER_PATTERN,
    MAX_INCIDENT_ID,
    SPOKEN_VERSIONS,
    VERSION,
    CallerKind,
    RefusedBy,
    printable_name,
)

# The protocol's bounds, the tap's and the monitor's alike (``kvcanary/wire.py``).
from kvcanary.wire import MAX_BODY_BYTES as MAX_BODY_BYTES
from kvcanary.wire import MAX_COUNT as MAX_COUNT
from kvcanary.wire import MAX_DROPPED as MAX_DROPPED
from kvcanary.wire import MAX_FINGERPRINTS as MAX_FINGERPRINTS
from kvcanary.wire import MAX_MARKERS as MAX_MARKERS
from kvcanary.wire import MAX_MESSAGES as MAX_MESSAGES
from kvcanary.wire import MAX_RECORDS as MAX_RECORDS
from kvcanary.wire import MAX_SECONDS as MAX_SECONDS
from kvcanary.wire import MAX_TIME as MAX_TIME
from kvcanary.wire import MAX_TOKENS as MAX_TOKENS
from kvcanary.wire import NAME_CHARS as NAME_CHARS
from kvcanary.wire import PRINT_END as FINGERPRINT_END

#: Errors a refused record's 422 names, then those of the whole batch; the rest are counted.
MAX_ERRORS_PER_RECORD = 5
MAX_ERRORS = 50
#: Characters of an error's message, and of each part of its path (a key a client chose), shown.
ERROR_TEXT_CHARS = 200
ERROR_KEY_CHARS = 64
#: The record's fields a client names things by: shown to people, so made printable on reading.
NAMES = ("id", "upstream_id", "caller", "api_base", "model", "model_group", "finish_reason")
_T = TypeVar("_T")

# --- the protocol's version ----------------------------------------------------------------------


def version_label(value: object) -> str:
    """Return how a version sent is named in a refusal and its metric: ``none`` (a tap before
    version 4 sends none), the integer as sent (0 to 999), else ``other``."""
    if value is None:
        return "none"
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 999:
        return str(value)
    return "other"


class UnspokenVersion(ValueError):
    """A batch or message of a tap protocol version this monitor does not speak: refused whole and
    never judged, since two versions print the same text differently (``docs/tap-protocol.md``,
    "Versions"). ``version``: its label (:func:`version_label`); ``records``: how many it held."""

    def __init__(self, version: object, records: int):
        self.version = version_label(version)
        self.records = records
        spoken = ", ".join(map(str, SPOKEN_VERSIONS))
        sent = "no version (a tap before version 4)" if version is None else f"version {self.version}"
        super().__init__(
            f"tap protocol {sent} is not spoken here: this monitor speaks version {spoken}; "
            "upgrade the tap (docs/tap-protocol.md, Versions)"
        )


def check_version(value: object, records: int) -> None:
    """Raise :class:`UnspokenVersion` unless ``value`` is a version this monitor speaks (an
    integer: ``4.0`` or ``"4"`` is no version)."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value in SPOKEN_VERSIONS):
        raise UnspokenVersion(value, records)


# --- what pydantic reads: the models the API documents and names refusals by ----------------------

Name = Annotated[str, StringConstraints(max_length=NAME_CHARS, pattern=r"^[^\x00]*$")]


def _integral(value: Any) -> Any:
    """A JSON number with no fraction (``2.0``) is the integer JSON Schema says it is; a boolean is
    no integer (the wire models are strict: lax pydantic reads ``true`` as 1)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integral = BeforeValidator(_integral)
Count = Annotated[int, Field(ge=0, le=MAX_COUNT), Integral]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Fingerprint = Annotated[int, Field(ge=0, lt=FINGERPRINT_END), Integral]
TokenPrint = Annotated[int, Field(ge=1, lt=FINGERPRINT_END), Integral]
Marker = Annotated[str, StringConstraints(pattern=f"^{MARKER_PATTERN}$")]


class Wire(BaseModel):
    # Strict, as msgspec reads a good batch: a JSON true or 2.0 where the wire says integer is not
    # one (lax pydantic would take them as 1 and 2, and a record's fate would hang on its batch).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PromptSizeWire(Wire, title="PromptSize"):
    chars: Count = 0
    bytes: Count = 0
    messages: Annotated[int, Field(ge=0, le=MAX_MESSAGES), Integral] = 0


class UsageWire(Wire, title="Usage"):
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    cached_tokens: Count | None = None


# FailFast: a list is refused at its first bad item, so a list of bad items costs one error.
class FingerprintsWire(Wire, title="Fingerprints"):
    prompt: Annotated[list[Fingerprint], Field(max_length=MAX_FINGERPRINTS), FailFast()] = []
    response: Annotated[list[Fingerprint], Field(max_length=MAX_FINGERPRINTS), FailFast()] = []


class DistinctiveWire(Wire, title="Distinctive"):
    """Keyed prints of the distinctive tokens (names, figures, identifiers) of the prompt, and
    of the response's that its prompt does not hold (``kvcanary/tap/distinctive.py``)."""

    prompt: Annotated[list[TokenPrint], Field(max_length=MAX_TOKENS), FailFast()] = []
    response: Annotated[list[TokenPrint], Field(max_length=MAX_TOKENS), FailFast()] = []


class RefusedWire(Wire, title="Refused"):
    """The gateway refused the request before any upstream call (tap protocol version 3)."""

    by: RefusedBy
    tokens: Count | None = None  # admission: the sure lower bound of the prompt's tokens
    kv_pool_tokens: Count | None = None  # admission: the pool that bound was over
    incident_id: Annotated[int, Field(ge=0, le=MAX_INCIDENT_ID), Integral] | None = None  # quarantine


class TrafficRecordWire(Wire, title="TrafficRecord"):
    """One request as the gateway saw it."""

    id: Name  # the record's identity, made by the tap per exchange: what it is judged once by
    #: The gateway's id of the response (the engine's), kept as data; None: an older tap's record,
    #: whose ``id`` is that id.
    upstream_id: Name | None = None
    time: Annotated[float, Field(ge=0, le=MAX_TIME)]  # epoch seconds the request started
    caller: Name = ""
    caller_kind: CallerKind = "unknown"
    key_hash: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{64})?$")] = ""  # a SHA-256, never a key
    api_base: Name
    model: Name = ""
    model_group: Name = ""
    stream: bool = False
    status: Annotated[int, Field(ge=100, le=599), Integral]
    finish_reason: Name | None = None
    latency_seconds: Seconds | None = None
    ttft_seconds: Seconds | None = None
    prompt: PromptSizeWire = PromptSizeWire()
    response_chars: Count = 0
    usage: UsageWire = UsageWire()
    markers: Annotated[list[Marker], Field(max_length=MAX_MARKERS), FailFast()] = []
    fingerprints: FingerprintsWire = FingerprintsWire()
    distinctive: DistinctiveWire = DistinctiveWire()  # none from a tap of protocol version 1
    truncated: bool = False
    refused: RefusedWire | None = None  # none before protocol version 3, or for a request served

    @model_validator(mode="after")
    def _refused_is_not_answered(self) -> TrafficRecordWire:
        if self.refused is not None and 200 <= self.status < 300:
            raise ValueError("refused: a request the gateway refused has no 2xx status")
        return self


BatchId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Gateway = Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.:-]*$")]


class TrafficBatch(Wire):
    """The envelope; its records are read one by one (:func:`valid_records`)."""

    #: The tap protocol's version (``kvcanary.wire.VERSION``): required over HTTP, where a batch of
    #: another version, or of none (a tap before version 4), is refused whole (:class:`UnspokenVersion`);
    #: a NATS message says it in its ``Kvcanary-Version`` header instead.
    version: Annotated[int, Field(description=f"The tap protocol's version: {VERSION}.")] | None = None
    #: The tap's id for this batch, the same when it sends it again (its answer lost): judged once.
    batch: BatchId | None = None
    gateway: Gateway = ""
    #: Records the tap dropped since its last accepted batch (the monitor was down or slow), at most
    #: ``MAX_DROPPED``: a tap with more to report reports the rest with its next batches.
    dropped: Annotated[int, Field(ge=0, le=MAX_DROPPED), Integral] = 0
    #: Anything, read one by one when the whole fails (valid_records): a ``null`` among them costs
    #: only itself, refused under its own index.
    records: Annotated[list[Any], Field(max_length=MAX_RECORDS)]


class _WholeBatch(TrafficBatch):
    # FailFast: one bad record is enough to read them one by one (valid_records).
    records: Annotated[list[TrafficRecordWire], Field(max_length=MAX_RECORDS), FailFast()]


class _PublicNames(GenerateJsonSchema):
    """Documents each wire model by the name the API and the code call it (``TrafficRecord``)."""

    def normalize_name(self, name: str) -> str:
        return super().normalize_name(name).removesuffix("Wire")


#: The body's JSON schema as the API documents it (each record in full).
BATCH_SCHEMA = _WholeBatch.model_json_schema(schema_generator=_PublicNames)
# As a body must be posted: with the version this monitor speaks (a NATS message's envelope is the
# same without it, its version in a header).
BATCH_SCHEMA["properties"]["version"] = {
    "const": VERSION,
    "description": f"The tap protocol's version: {VERSION}. Another, or none, is refused (400).",
}
BATCH_SCHEMA["required"] = ["version", *BATCH_SCHEMA.get("required", [])]

# --- what msgspec reads: the records the judge reads ----------------------------------------------

# Python's re.search, so anchored with ``\Z``; ASCII classes only (pydantic's Rust regex folds case
# by Unicode: a Kelvin sign reads as a K there, and is left to pydantic here). No NUL in a name:
# read_batch and model_validate_json look for one in the body (the module doc).
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
    :class:`TrafficRecordWire`. Made by :func:`read_batch` or :meth:`model_validate` (constructing
    one validates nothing); ``model_validate``, ``model_validate_json`` and ``model_dump`` are the
    pydantic model's, kept for the callers that read and write records with them."""

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


class _Envelope(_Struct, frozen=True, kw_only=True):
    """A batch as msgspec reads it first: the envelope checked, each record's JSON found and left
    unread (``msgspec.Raw``, a view of the body), to be read one at a time."""

    version: Any = None  # any value read: one not spoken is refused by name (check_version)
    batch: Annotated[str, Meta(pattern=r"^[0-9a-f]{32}\Z")] | None = None
    gateway: Annotated[str, Meta(max_length=64, pattern=r"^[A-Za-z0-9_.:-]*\Z")] = ""
    dropped: Annotated[int, Meta(ge=0, le=MAX_DROPPED)] = 0
    records: Annotated[list[msgspec.Raw], Meta(max_length=MAX_RECORDS)]


class _Versioned(msgspec.Struct):
    """What a body msgspec cannot read as a batch still says: its version and how many records."""

    version: Any = None
    records: list[msgspec.Raw] | None = None


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_VERSIONED = msgspec.json.Decoder(_Versioned)
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
    """Whether every key hash is a SHA-256 in lowercase hex, or empty, and no refused record has a
    2xx status (what the decoder leaves to pydantic, which names the field)."""
    return all(
        (not r.key_hash or (len(r.key_hash) == 64 and not r.key_hash.strip(_HEX)))
        and (r.refused is None or not 200 <= r.status < 300)
        for r in records
    )


def _judged(wire: TrafficRecordWire) -> TrafficRecord:
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


@dataclass
class ValidRecords:
    records: list[TrafficRecord]
    #: The first errors of the refused records (``bounded_errors``), their ``loc`` starting
    #: ``("records", index)``: at most ``MAX_ERRORS_PER_RECORD`` a record, ``MAX_ERRORS`` in all.
    errors: list[dict[str, Any]]
    refused: int
    #: Errors found and not listed in ``errors`` (a record's unknown keys past the first few are
    #: not looked for, so this is a floor).
    omitted: int = 0


def read_batch(body: bytes, *, versioned: bool = True) -> tuple[TrafficBatch, ValidRecords]:
    """Return the envelope and its valid records, their names printable; raise ValidationError for
    a bad envelope (name it with :func:`bounded_errors`), and :class:`UnspokenVersion` for a body
    whose ``version`` this monitor does not speak (``versioned``: the body says its version, as
    over HTTP; a NATS message's payload does not, its header does).

    msgspec reads the envelope, finding each record's JSON without reading it; then each record is
    read on its own, by msgspec (the common case), else by pydantic, which names what is wrong with
    it. No step reads more than one record at once, so a thread reading a large body lets the event
    loop run between records (a C call holds the GIL for as long as it runs: one call over a body of
    1,000 records with every print a side held it for 177 ms; a record's call takes 0.2 ms). A body
    msgspec cannot read as an envelope, or holding JSON that pydantic reads otherwise, is read whole
    by pydantic."""
    try:
        envelope = _ENVELOPE.decode(body)
    except msgspec.DecodeError:  # malformed, or a bad envelope: pydantic names it
        if versioned:
            _check_version_of_unread(body)
        return _read_by_pydantic(body, versioned=versioned)
    if versioned:
        check_version(envelope.version, len(envelope.records))
    valid = ValidRecords([], [], 0)
    for i, raw in enumerate(envelope.records):
        data = bytes(raw)
        record = _decoded(_RECORD, data)
        if record is not None and _fits([record]):
            valid.records.append(printable(record))
            continue
        try:
            parsed = from_json(data)
        except ValueError:  # JSON msgspec took and pydantic does not (a lone surrogate, bad UTF-8)
            return _read_by_pydantic(body, versioned=versioned)
        _validate(valid, i, parsed)
    head = TrafficBatch.model_construct(
        version=envelope.version, batch=envelope.batch, gateway=envelope.gateway, dropped=envelope.dropped,
        records=[],
    )  # fmt: skip
    return head, valid


def _check_version_of_unread(body: bytes) -> None:
    """Raise :class:`UnspokenVersion` for a body msgspec cannot read as a batch but whose version
    it can read, and is not spoken: an old tap's body is refused for its version, whatever else."""
    try:
        found = _VERSIONED.decode(body)
    except msgspec.DecodeError:
        return
    check_version(found.version, len(found.records or ()))


def _read_by_pydantic(body: bytes, *, versioned: bool = True) -> tuple[TrafficBatch, ValidRecords]:
    """Read ``body`` by pydantic alone, whole (what :func:`read_batch` must agree with)."""
    try:
        whole = _WholeBatch.model_validate_json(body)
    except ValidationError:
        batch = TrafficBatch.model_validate_json(body)
        if versioned:
            check_version(batch.version, len(batch.records))
        return batch, valid_records(batch)
    if versioned:
        check_version(whole.version, len(whole.records))
    envelope = TrafficBatch.model_construct(
        version=whole.version, batch=whole.batch, gateway=whole.gateway, dropped=whole.dropped, records=[]
    )
    return envelope, ValidRecords([_judged(r) for r in whole.records], [], 0)


def valid_records(batch: TrafficBatch) -> ValidRecords:
    """Validate each record of ``batch`` on its own: the good ones, and the first few things wrong
    with the rest (``ValidRecords``)."""
    valid = ValidRecords([], [], 0)
    for i, raw in enumerate(batch.records):
        _validate(valid, i, raw)
    return valid


def _validate(valid: ValidRecords, index: int, raw: Any) -> None:
    """Add record ``index`` of a batch (its JSON as Python values) to ``valid``: the record, or its
    first errors, within the bounds of the record and of the batch."""
    try:
        valid.records.append(TrafficRecord.model_validate(_few_unknown_keys(raw, TrafficRecordWire)))
    except ValidationError as exc:
        valid.refused += 1
        room = min(MAX_ERRORS_PER_RECORD, MAX_ERRORS - len(valid.errors))
        kept, left = bounded_errors(exc, ("records", index), room)
        valid.errors += kept
        valid.omitted += left


def bounded_errors(
    exc: ValidationError, prefix: tuple[str | int, ...] = (), room: int = MAX_ERRORS
) -> tuple[list[dict[str, Any]], int]:
    """Return the first ``room`` of ``exc``'s errors as a 422 lists them (type, path under
    ``prefix``, message; never the input, each text bounded), and how many were left out."""
    found = exc.error_count()
    kept = [
        {
            "type": error["type"],
            "loc": (
                *prefix,
                *(part if isinstance(part, int) else plain(part, ERROR_KEY_CHARS) for part in error["loc"]),
            ),
            "msg": plain(error["msg"], ERROR_TEXT_CHARS),
        }
        for error in exc.errors(include_url=False, include_input=False, include_context=False)[: max(room, 0)]
    ]
    return kept, found - len(kept)


#: The objects inside a record, by key, whose unknown keys are trimmed as the record's are.
_NESTED: dict[str, type[Wire]] = {
    "prompt": PromptSizeWire,
    "usage": UsageWire,
    "fingerprints": FingerprintsWire,
    "distinctive": DistinctiveWire,
}


def _few_unknown_keys(raw: Any, model: type[Wire]) -> Any:
    """``raw`` with at most ``MAX_ERRORS_PER_RECORD`` keys ``model`` does not know, here and in its
    nested objects: pydantic names each unknown key, after the known fields and in the order sent,
    so a record of a million unknown keys is refused with the same first errors, at a record's cost."""
    if not isinstance(raw, dict):
        return raw
    known = model.model_fields
    unknown = 0
    trimmed: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            unknown += 1
            if unknown > MAX_ERRORS_PER_RECORD:
                continue
        trimmed[key] = (
            _few_unknown_keys(value, _NESTED[key]) if model is TrafficRecordWire and key in _NESTED else value
        )
    return trimmed
