"""The one envelope of a result in flight: from the runner, through the writer and the spool, to the recorder.

A probe returns a :class:`~probes.base.ProbeResult`; the runner wraps it once, as it is, with what
the database needs to file it (the target's identity, the kind, the node, when it ran), into a
:class:`PendingResult`; the traffic judge wraps each check's verdict the same way. Its ``source``
says which of the two judged it, as a field, never read from the kind's name. Every stage after
that (``writer.py``, ``recorder.py``, ``spool.py``) takes and passes on this one object with its
values typed (the verdict an enum, the times datetimes); only the spool turns it into JSON and back
(:meth:`PendingResult.stored`, :meth:`PendingResult.from_stored`), so a result replayed after a
restart is the result that was queued.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kvcanary.monitor.storage.db import utcnow
from kvcanary.probes.base import ProbeResult, Verdict

if TYPE_CHECKING:
    from kvcanary.monitor.config.targets import TargetConfig


class Source(enum.StrEnum):
    """Who judged a result: a probe run, or a traffic check on gateway records
    (``monitor/traffic/checks/``)."""

    PROBE = "probe"
    TRAFFIC = "traffic"


@dataclass
class PendingResult:
    """One result waiting to be recorded: everything ``record_result`` needs."""

    target: str
    engine: str
    base_url: str
    model: str
    kind: str
    #: What the probe or check concluded, as it returned it (its state is stored with the result).
    result: ProbeResult
    started_at: datetime
    duration_seconds: float
    #: When recording was first attempted: the time incident changes are stamped with.
    attempted_at: datetime
    node: str = ""
    source: Source = Source.PROBE
    #: Its place in the spool (``spool.py``); 0 until spooled.
    seq: int = 0

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
        source: Source = Source.PROBE,
    ) -> PendingResult:
        """Wrap ``result`` of a run of ``kind`` on ``target`` (on ``node``) that began at ``started_at``;
        ``now`` (default: the current time) is when recording is first attempted; ``source`` who judged."""
        return cls(
            target=target.name,
            engine=target.engine,
            base_url=target.base_url,
            model=target.model,
            kind=kind,
            result=result,
            started_at=started_at,
            duration_seconds=duration,
            attempted_at=now or utcnow(),
            node=node,
            source=source,
        )

    @property
    def target_key(self) -> tuple[str, str, str, str]:
        """The target's identity as its row stores it: (name, engine, base_url, model)."""
        return (self.target, self.engine, self.base_url, self.model)

    @property
    def suspected(self) -> bool:
        """Whether this is a failure only suspected: what a verification is run for."""
        return self.result.certainty == "suspected" and self.result.verdict.is_failure

    def stored(self) -> dict[str, Any]:
        """Return the entry as a spool file holds it: flat, JSON's types (:meth:`from_stored` reads it)."""
        result = self.result
        return {
            "target": self.target, "engine": self.engine, "base_url": self.base_url, "model": self.model,
            "kind": self.kind, "verdict": result.verdict.value, "reason": result.reason,
            "detail": result.detail, "evidence": result.evidence, "measurements": result.measurements,
            "started_at": self.started_at.isoformat(), "duration_seconds": self.duration_seconds,
            "attempted_at": self.attempted_at.isoformat(), "node": self.node, "state": result.state,
            "seq": self.seq, "source": self.source.value, "certainty": result.certainty,
        }  # fmt: skip

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> PendingResult:
        """Return the entry a spool file holds. Raise TypeError or ValueError for one that is not.

        An entry spooled before ``source`` and ``certainty`` existed is a probe's, and certain; one
        spooled by 0.1.0 names the kind ``probe``."""
        data = dict(data)
        if "probe" in data and "kind" not in data:
            data["kind"] = data.pop("probe")
        suspected = data.pop("certainty", "certain") == "suspected"
        try:
            result = ProbeResult(
                Verdict(data.pop("verdict")), data.pop("reason"), data.pop("detail", ""),
                data.pop("evidence", {}), data.pop("measurements", {}), data.pop("state", None),
                certainty="suspected" if suspected else "certain",
            )  # fmt: skip
            started_at, attempted_at = (
                datetime.fromisoformat(data.pop(k)) for k in ("started_at", "attempted_at")
            )
        except KeyError as exc:
            raise TypeError(f"an entry without {exc}") from None
        source = Source(data.pop("source", Source.PROBE))
        return cls(**data, result=result, started_at=started_at, attempted_at=attempted_at, source=source)
