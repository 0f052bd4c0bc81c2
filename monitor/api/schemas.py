"""Response bodies of the REST API. Built from rows by the ``of`` constructors; nothing secret is
stored, so nothing secret can be served (target URLs are kept without credentials)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Row

from kvcanary.monitor.storage.models import (
    EventKind,
    IncidentCertainty,
    IncidentEvent,
    ResultCertainty,
    Severity,
    State,
    Verdict,
)


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class Problem(_Out):
    """An error answer: what was refused and why (every error status but 422, whose ``detail``
    lists each parameter at fault)."""

    detail: str


NODE_HELP = "The node it is about; empty for probes that judge the whole target."


class IncidentOut(_Out):
    id: int
    target: str
    probe: str
    node: str = Field(description=NODE_HELP)
    severity: Severity
    state: State
    title: str
    opened_at: datetime
    last_failure_at: datetime = Field(description="Start of the latest result that counted against it.")
    resolved_at: datetime | None
    failure_count: int
    consecutive_passes: int
    last_verdict: Verdict
    last_reason: str
    certainty: IncidentCertainty = Field(
        description="How its failures are known: certain (proof), suspected (a traffic check's hint, "
        "verified by probes at once; moves no traffic), or confirmed by an operator."
    )

    @classmethod
    def of(cls, row: Row[Any]) -> IncidentOut:
        """Build from a row of ``monitor.storage.queries`` (``row.target`` is the target's name)."""
        # From a dict, not attribute by attribute: five times faster on a 500-row page.
        return cls.model_validate(row._asdict())


NEXT_CURSOR_HELP = "Pass as `cursor` to get the next page; null: nothing more matches."
LIMIT_HELP = "The page size asked for; a page may hold fewer items and still have a next_cursor."


class IncidentPage(_Out):
    """A page of incidents, newest opened first."""

    items: list[IncidentOut]
    next_cursor: str | None = Field(description=NEXT_CURSOR_HELP)
    limit: int = Field(description=LIMIT_HELP)


class IncidentEventOut(_Out):
    id: int
    created_at: datetime
    kind: EventKind
    old_state: State | None
    new_state: State
    old_severity: Severity | None
    new_severity: Severity
    verdict: Verdict | None
    reason: str | None
    probe_result_id: int | None = Field(description="The result that caused it; null once pruned.")
    processed_at: datetime | None = Field(description="When an Alertmanager accepted it; null: not yet.")
    attempts: int = Field(description="Delivery attempts so far.")
    note: str | None = Field(
        description="What an operator said (confirmed, dismissed) or what a verification ran and found."
    )

    @classmethod
    def of(cls, row: IncidentEvent) -> IncidentEventOut:
        return cls(**{name: getattr(row, name) for name in cls.model_fields})


class ProbeResultOut(_Out):
    id: int
    target: str
    probe: str
    node: str = Field(description=NODE_HELP)
    verdict: Verdict
    reason: str
    detail: str
    started_at: datetime
    duration_seconds: float
    status_code: int | None
    latency_seconds: float | None
    ttft_seconds: float | None
    prompt_tokens_sent: int | None
    prompt_tokens_reported: int | None
    evidence: dict[str, Any] = Field(description="Redacted by the probe: marker ids, hashes, excerpts.")
    incident_id: int | None
    expires_at: datetime
    certainty: ResultCertainty | None = Field(
        description="How a leak or mismatch is known: certain or suspected; null for a pass or an error."
    )

    @classmethod
    def of(cls, row: Row[Any]) -> ProbeResultOut:
        """Build from a row of ``monitor.storage.queries`` (``row.target`` is the target's name)."""
        # From a dict, not attribute by attribute: five times faster on a 500-row page.
        return cls.model_validate(row._asdict())


class ProbeResultPage(_Out):
    """A page of probe results, newest first."""

    items: list[ProbeResultOut]
    next_cursor: str | None = Field(description=NEXT_CURSOR_HELP)
    limit: int = Field(description=LIMIT_HELP)


class IncidentDetailOut(IncidentOut):
    events: list[IncidentEventOut] = Field(description="The timeline, oldest first.")
    results: list[ProbeResultOut] = Field(description="The most recent linked results, newest first.")


class LastVerdictOut(_Out):
    verdict: Verdict
    started_at: datetime
    reason: str
    node: str = Field("", description=NODE_HELP + " A path is named 'prefill--decode'.")


class OpenIncidentOut(_Out):
    id: int
    probe: str
    node: str = Field(description=NODE_HELP + " A path is named 'prefill--decode': the pair it came from.")
    severity: str
    opened_at: datetime
    certainty: IncidentCertainty


class IncidentWordIn(_Out):
    note: str = Field(
        min_length=1, max_length=300, pattern=r"^[^\x00]*$",
        description="Why, in one line: kept in the incident's timeline and shown to on-call.",
    )  # fmt: skip


class TargetOut(_Out):
    name: str
    engine: str
    base_url: str = Field(description="Without credentials or query string.")
    model: str
    probes: list[str]
    last_verdicts: dict[str, LastVerdictOut] = Field(
        description="The latest verdict of each configured probe, on whichever node or path it ran last; "
        "a probe not judged yet is absent. A later pass elsewhere does not hide an open incident: see "
        "open_incidents."
    )
    open_incidents: list[OpenIncidentOut] = Field(
        default_factory=list,
        description="The target's open incidents, newest first (at most 50; the incidents API has them all), "
        "each with the node or prefill--decode path it came from.",
    )


class TargetList(_Out):
    items: list[TargetOut]


class ProbeRunOut(_Out):
    probe: str
    node: str = Field("", description=NODE_HELP)
    verdict: Verdict
    reason: str
    detail: str
    result_id: int | None = Field(description="null when the result could not be stored.")
    incident_id: int | None


class RunOut(_Out):
    target: str
    run_id: str = Field(description="Read it again at /api/v1/targets/{target}/runs/{run_id}.")
    status: Literal["running", "done", "failed"]
    results: list[ProbeRunOut] = Field(description="Each probe's verdict once the run is done; [] before.")
    error: str | None = None


class ReloadOut(_Out):
    status: Literal["reloaded"]


class HealthOut(BaseModel):
    """Health of the process: the database and the scheduler, plus whatever the monitor reports."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ok", "unhealthy"]
    database: Literal["ok", "unreachable", "unwritable"]
    scheduler: str | None = None
