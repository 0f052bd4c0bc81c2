"""The monitor's database in tests: results recorded the way the runner records them, on a fixed
clock, and the tables emptied between tests (``tests/monitor/conftest.py`` builds the databases).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, delete, text
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import IncidentConfig, RetentionConfig
from kvcanary.monitor.incidents import RecordOutcome, record_result
from kvcanary.monitor.storage.models import (
    Incident,
    IncidentEvent,
    ProbeResultRow,
    QuarantineChange,
    Target,
    TrafficJudged,
    TrafficMinute,
    TrafficRecordRow,
)
from kvcanary.probes.base import Certainty, ProbeResult, Verdict

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
POLICY = IncidentConfig(resolve_after_passes=3, error_warning_after_seconds=300)
RETENTION = RetentionConfig(pass_days=7, failure_days=90)


def empty_tables(engine: Engine) -> None:
    """Delete every row, children first. A transaction a test left open fails this, not hangs it."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SET LOCAL lock_timeout = '30s'"))
        children_first = (
            TrafficJudged,
            TrafficRecordRow,
            TrafficMinute,
            QuarantineChange,
            IncidentEvent,
            ProbeResultRow,
            Incident,
            Target,
        )
        for model in children_first:
            conn.execute(delete(model))


def outcome(
    verdict: str, reason: str = "", detail: str = "", certainty: Certainty = "certain", **measurements: float
) -> ProbeResult:
    """A probe's result with ``verdict``; ``reason`` defaults to a plausible token per verdict."""
    default = {"pass": "ok", "leak": "foreign_marker", "mismatch": "wrong_answer", "error": "timeout"}
    return ProbeResult(
        Verdict(verdict),
        reason or default[verdict],
        detail or f"{verdict} seen",
        evidence={"marker_ids": ["m-1"]} if verdict == "leak" else {},
        measurements=dict(measurements),
        certainty=certainty,
    )


def record(
    factory: sessionmaker[Session],
    verdict: str,
    *,
    at: datetime,
    target: str = "glm-prod",
    probe: str = "cross_tenant",
    policy: IncidentConfig = POLICY,
    reason: str = "",
    detail: str = "",
    node: str = "",
    certainty: Certainty = "certain",
    **measurements: float,
) -> RecordOutcome:
    """Record one result (of ``node``: empty for the whole target) in its own committed transaction,
    the way the runner does."""
    with factory() as s, s.begin():
        return record_result(
            s,
            target_name=target,
            engine="sglang",
            base_url="http://127.0.0.1:30000/v1",
            model="glm-5.3",
            probe=probe,
            result=outcome(verdict, reason, detail, certainty, **measurements),
            started_at=at,
            duration_seconds=0.5,
            policy=policy,
            retention=RETENTION,
            now=at + timedelta(seconds=1),
            node=node,
        )


def minutes(n: float) -> datetime:
    return T0 + timedelta(minutes=n)
