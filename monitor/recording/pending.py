"""The one envelope of a result in flight: from the runner, through the writer and the spool, to the recorder.

A probe returns a :class:`~probes.base.ProbeResult`; the runner wraps it once, with what the
database needs to file it (the target's identity, the kind, the node, when it ran), into a
:class:`PendingResult`; the traffic judge wraps each check's verdict the same way. Its ``source``
says which of the two judged it, as a field, never read from the kind's name. Every stage after
that (``writer.py``, ``recorder.py``, ``spool.py``) takes and passes on this one object, and the
spool stores it as it is, so a result replayed after a restart is the result that was queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kvcanary.monitor.storage.db import utcnow
from kvcanary.probes.base import ProbeResult, Verdict

if TYPE_CHECKING:
    from kvcanary.monitor.config.targets import TargetConfig

#: The sources of a verdict (:attr:`PendingResult.source`).
PROBE = "probe"
TRAFFIC = "traffic"


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
    #: Who judged: ``probe`` (a probe run) or ``traffic`` (a traffic check on gateway records,
    #: ``monitor/traffic/checks/``). An entry spooled before the field existed has none: ``probe``.
    source: str = PROBE
    #: How a failure is known (``probes/base.py``): ``certain`` or ``suspected``.
    certainty: str = "certain"

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
        source: str = PROBE,
    ) -> PendingResult:
        """Wrap ``result`` of a run of ``kind`` on ``target`` (on ``node``) that began at ``started_at``;
        ``now`` (default: the current time) is when recording is first attempted; ``source`` who judged."""
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
            source=source,
            certainty=result.certainty,
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

    @property
    def suspected(self) -> bool:
        """Whether this is a failure only suspected: what a verification is run for."""
        return self.certainty == "suspected" and Verdict(self.verdict).is_failure

    def result(self) -> ProbeResult:
        return ProbeResult(
            Verdict(self.verdict), self.reason, self.detail, self.evidence, self.measurements,
            certainty="suspected" if self.certainty == "suspected" else "certain",
        )  # fmt: skip
