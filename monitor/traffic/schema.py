"""The wire of ``POST /api/v1/traffic``: a batch of per-request records from a gateway tap.

Every field is bounded, so a hostile or broken tap costs a 4xx naming the field and nothing else:
no string longer than a name, no list longer than the tap sends, no number out of range. A record
carries no text: sizes, usage, timings, marker-shaped strings and keyed fingerprints
(``kvcanary/tap/record.py`` builds them).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

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
    key_hash: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{0,128}$")] = ""
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
    gateway: Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.:-]*$")] = ""
    #: Records the tap dropped since its last accepted batch (the monitor was down or slow).
    dropped: Count = 0
    records: Annotated[list[TrafficRecord], Field(max_length=MAX_RECORDS)]
