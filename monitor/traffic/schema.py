"""The wire of ``POST /api/v1/traffic``: a batch of per-request records from a gateway tap.

Every field is bounded, so a hostile or broken tap costs a 4xx naming the field and nothing else:
no string longer than a name, no list longer than the tap sends, no number out of range. The
envelope (:class:`TrafficBatch`) is validated first; then each record on its own
(:func:`valid_records`), so one bad record is refused, named, and costs none of the others. A record
carries no text: sizes, usage, timings, marker-shaped strings and keyed fingerprints
(``kvcanary/tap/record.py`` builds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

MAX_RECORDS = 1000
#: Bytes a batch's body may take (a full batch of records with every fingerprint a side allows).
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_FINGERPRINTS = 1024
MAX_MARKERS = 32

Name = Annotated[str, StringConstraints(max_length=200, pattern=r"^[^\x00]*$")]
Count = Annotated[int, Field(ge=0, le=10**12)]
Seconds = Annotated[float, Field(ge=0, le=86_400 * 7)]
Fingerprint = Annotated[int, Field(ge=0, lt=2**53)]
Marker = Annotated[str, StringConstraints(pattern=r"^(?i:KVC-[0-9a-f]{8}-[0-9a-f]{32})$")]
CallerKind = Literal["team", "key_alias", "key_hash", "end_user", "unknown"]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PromptSize(Wire):
    chars: Count = 0
    bytes: Count = 0
    messages: Annotated[int, Field(ge=0, le=100_000)] = 0


class Usage(Wire):
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    cached_tokens: Count | None = None


class Fingerprints(Wire):
    prompt: Annotated[list[Fingerprint], Field(max_length=MAX_FINGERPRINTS)] = []
    response: Annotated[list[Fingerprint], Field(max_length=MAX_FINGERPRINTS)] = []


class TrafficRecord(Wire):
    """One request as the gateway saw it."""

    id: Name
    time: Annotated[float, Field(ge=0, le=2**33)]  # epoch seconds the request started
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
    prompt: PromptSize = PromptSize()
    response_chars: Count = 0
    usage: Usage = Usage()
    markers: Annotated[list[Marker], Field(max_length=MAX_MARKERS)] = []
    fingerprints: Fingerprints = Fingerprints()
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class TrafficBatch(Wire):
    """The envelope; its records are read one by one (:func:`valid_records`)."""

    #: The tap's id for this batch, the same when it sends it again (its answer lost): judged once.
    batch: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")] | None = None
    gateway: Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.:-]*$")] = ""
    #: Records the tap dropped since its last accepted batch (the monitor was down or slow).
    dropped: Count = 0
    #: Anything, read one by one when the whole fails (valid_records): a ``null`` among them costs
    #: only itself, refused under its own index.
    records: Annotated[list[Any], Field(max_length=MAX_RECORDS)]


class _WholeBatch(TrafficBatch):
    records: Annotated[list[TrafficRecord], Field(max_length=MAX_RECORDS)]


#: The body's JSON schema as the API documents it (each record in full).
BATCH_SCHEMA = _WholeBatch.model_json_schema()


@dataclass
class ValidRecords:
    records: list[TrafficRecord]
    #: Each refused record's errors, their ``loc`` starting ``("records", index)``.
    errors: list[dict[str, Any]]
    refused: int


def read_batch(body: bytes) -> tuple[TrafficBatch, ValidRecords]:
    """Return the envelope and its valid records. A whole good batch is read in one pass (the
    common case, and 2.5 times cheaper); a batch with a bad record is read again one record at a
    time. Raise ValidationError for a bad envelope."""
    try:
        whole = _WholeBatch.model_validate_json(body)
    except ValidationError:
        batch = TrafficBatch.model_validate_json(body)
        return batch, valid_records(batch)
    envelope = TrafficBatch.model_construct(
        batch=whole.batch, gateway=whole.gateway, dropped=whole.dropped, records=[]
    )
    return envelope, ValidRecords(whole.records, [], 0)


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
