"""The one envelope of a result in flight: from the runner, through the writer and the spool, to the recorder.

A probe returns a :class:`~probes.base.ProbeResult`; the runner wraps it once, with what the
database needs to file it (the target's identity, the kind, the node, when it ran), into a
:class:`PendingResult`. Every stage after that (``writer.py``, ``recorder.py``, ``spool.py``) takes
and passes on this one object, and the spool stores it as it is, so a result replayed after a
restart is the result that was queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from monitor.storage.db import utcnow
from probes.base import ProbeResult, Verdict

if TYPE_CHECKING:
    from monitor.config.targets import TargetConfig


@dataclass
class PendingResult:
    """One probe result waiting to be recorded: everything ``record_result`` needs."""

    target: str
    engine: str
    base_url: str
    model: str
    kind: str
    verdict: str
    reason: str
    detail: str
    evidence: dict[str, Any]
    measurements: dict[str, float]
    started_at: str  # ISO 8601, UTC
    duration_seconds: float
    attempted_at: str  # when recording first failed: the time incident changes are stamped with
    node: str = ""
    state: dict[str, Any] | None = None  # what the probe carries to its next run, stored with the result
    seq: int = field(default=0)

    @classmethod
    def of(
        cls,
        target: TargetConfig,
        kind: str,
        result: ProbeResult,
        started_at: datetime,
        duration: float,
        now: datetime | None = None,
        node: str = "",
    ) -> PendingResult:
        """Wrap ``result`` of a run of ``kind`` on ``target`` (on ``node``) that began at ``started_at``;
        ``now`` (default: the current time) is when recording is first attempted."""
        return cls(
            target=target.name,
            engine=target.engine,
            base_url=target.base_url,
            model=target.model,
            kind=kind,
            verdict=result.verdict.value,
            reason=result.reason,
            detail=result.detail,
            evidence=result.evidence,
            measurements=result.measurements,
            started_at=started_at.isoformat(),
            duration_seconds=duration,
            attempted_at=(now or utcnow()).isoformat(),
            node=node,
            state=result.state,
        )

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> PendingResult:
        """Return the entry a spool file holds. Raise TypeError or ValueError for one that is not.

        Entries spooled by 0.1.0 name the kind ``probe``: still read, for one release."""
        if "probe" in data and "kind" not in data:
            data = {**data, "kind": data["probe"]}
            del data["probe"]
        return cls(**data)

    @property
    def target_key(self) -> tuple[str, str, str, str]:
        """The target's identity as its row stores it: (name, engine, base_url, model)."""
        return (self.target, self.engine, self.base_url, self.model)

    def result(self) -> ProbeResult:
        return ProbeResult(Verdict(self.verdict), self.reason, self.detail, self.evidence, self.measurements)
