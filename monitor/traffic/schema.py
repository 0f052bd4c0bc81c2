"""The wire of ``POST /api/v1/traffic`` as the API documents it: a batch of per-request records from
a gateway tap, every field bounded, as pydantic models (``*Wire``) that name a bad field in a 422.

A record carries no text (``kvcanary/tap/record.py`` builds it); its bounds, caller kinds and marker
pattern are the protocol's, stated once in ``kvcanary/wire.py`` for the tap and the monitor alike. A
batch of a tap protocol version this monitor does not speak, or of none, is refused whole
(:class:`UnspokenVersion`) and counted (``monitor/metrics/versions.py``), never judged: two versions
print the same text differently, and one deployment's fingerprint window must hold one. Reading a
body is ``reading.py``'s; the record the judge reads is ``judged_record.py``'s.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    FailFast,
    Field,
    StringConstraints,
    model_validator,
)
from pydantic.json_schema import GenerateJsonSchema

from kvcanary.wire import (
    MARKER_PATTERN,
    MAX_INCIDENT_ID,
    SPOKEN_VERSIONS,
    VERSION,
    CallerKind,
    RefusedBy,
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


class WholeBatch(TrafficBatch):
    # FailFast: one bad record is enough to read them one by one (valid_records).
    records: Annotated[list[TrafficRecordWire], Field(max_length=MAX_RECORDS), FailFast()]


class _PublicNames(GenerateJsonSchema):
    """Documents each wire model by the name the API and the code call it (``TrafficRecord``)."""

    def normalize_name(self, name: str) -> str:
        return super().normalize_name(name).removesuffix("Wire")


#: The body's JSON schema as the API documents it (each record in full).
BATCH_SCHEMA = WholeBatch.model_json_schema(schema_generator=_PublicNames)
# As a body must be posted: with the version this monitor speaks (a NATS message's envelope is the
# same without it, its version in a header).
BATCH_SCHEMA["properties"]["version"] = {
    "const": VERSION,
    "description": f"The tap protocol's version: {VERSION}. Another, or none, is refused (400).",
}
BATCH_SCHEMA["required"] = ["version", *BATCH_SCHEMA.get("required", [])]
