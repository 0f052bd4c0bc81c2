"""Turn a probe's result into a ``probe_result`` row: bounded text, plain JSON, finite numbers, an expiry.

The incident rules that follow live in ``monitor/incidents.py``.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from kvcanary.monitor.storage.models import VERDICTS, ProbeResultRow
from kvcanary.monitor.storage.retention import has_excerpts
from kvcanary.monitor.storage.storable import jsonable, storable_text

if TYPE_CHECKING:
    from kvcanary.monitor.config.settings import RetentionConfig
    from kvcanary.probes.base import ProbeResult


REASON_CHARS = 64


DETAIL_CHARS = 2000


TITLE_CHARS = 200


# probe_result's integer columns are 32-bit on PostgreSQL; a target's absurd count must not fail the row.
_INT32 = 2**31


def new_probe_result(
    *,
    probe: str,
    node: str = "",
    result: ProbeResult,
    started_at: datetime,
    duration_seconds: float,
    retention: RetentionConfig,
) -> ProbeResultRow:
    """Return an unsaved probe_result row for ``result``, without its ``target_id``.

    ``expires_at`` is ``started_at`` + ``retention.pass_days`` for a pass and
    ``retention.failure_days`` for anything else: failure evidence outlives success evidence.
    Raise ValueError for a verdict outside pass|leak|mismatch|error.
    """
    return ProbeResultRow(**probe_result_values(probe, node, result, started_at, duration_seconds, retention))


def probe_result_values(
    probe: str,
    node: str,
    result: ProbeResult,
    started_at: datetime,
    duration_seconds: float,
    retention: RetentionConfig,
) -> dict[str, Any]:
    """Return the column values of a probe_result row for ``result`` (see :func:`new_probe_result`)."""
    verdict = str(result.verdict)
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, not {verdict!r}")
    days = retention.pass_days if verdict == "pass" else retention.failure_days
    evidence = jsonable(result.evidence)
    holds_excerpts = has_excerpts(evidence)
    return dict(
        probe=probe,
        node=node,
        verdict=verdict,
        reason=storable_text(result.reason)[:REASON_CHARS],
        detail=storable_text(result.detail)[:DETAIL_CHARS],
        started_at=started_at,
        duration_seconds=float(duration_seconds),
        certainty=result.certainty if verdict in ("leak", "mismatch") else None,
        evidence=evidence,
        incident_id=None,
        expires_at=started_at + timedelta(days=days),
        excerpts_until=started_at + timedelta(days=retention.excerpt_days) if holds_excerpts else None,
        **_measurements(result.measurements),
    )


def insert_rows(session: Session, rows: list[dict[str, Any]]) -> list[int]:
    """Insert probe_result rows given as column values, in one statement; return their ids in order.

    For results that change no incident (a pass while none is open): no ORM object, no flush per
    row. Most results are these.
    """
    if not rows:
        return []
    stmt = insert(ProbeResultRow).returning(ProbeResultRow.id, sort_by_parameter_order=True)
    return list(session.scalars(stmt, rows).all())


def _measurements(measurements: dict[str, float]) -> dict[str, Any]:
    """Pick the stored measurements; absent or non-finite ones become NULL."""

    def number(key: str) -> float | None:
        value = measurements.get(key)
        if value is None:
            return None
        try:
            value = float(value)
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None

    def integer(key: str) -> int | None:
        value = number(key)
        return int(value) if value is not None and abs(value) < _INT32 else None

    return {
        "latency_seconds": number("latency_seconds"),
        "ttft_seconds": number("ttft_seconds"),
        "status_code": integer("status_code"),
        "prompt_tokens_sent": integer("prompt_tokens_sent"),
        "prompt_tokens_reported": integer("prompt_tokens_reported"),
    }


def incident_title(row: ProbeResultRow, target: str, severity: str, lasted: float | None = None) -> str:
    """Return a one-line title for an incident opened or escalated by ``row``, at most TITLE_CHARS:
    ``leak on glm-prod/cross_tenant: <detail>``; a ``warning`` says how long errors ``lasted``."""
    what = row.detail or row.reason
    where = f"{target}/{row.probe}" + (f" ({row.node})" if row.node else "")
    if severity == "warning":
        head = f"errors on {where}" + (f" for {int(lasted)}s" if lasted is not None else "")
        what = f"{row.reason}: {row.detail}" if row.detail else row.reason
    else:
        head = f"{row.verdict} on {where}"
    title = " ".join(f"{head}: {what}".split())
    if len(title) <= TITLE_CHARS:
        return title
    cut = title[: TITLE_CHARS - 1]
    # Ends on a whole word where one ends in the title's second half: a title cut mid-word misleads.
    whole = cut[: cut.rfind(" ")].rstrip(" ,;:") if cut.rfind(" ") > TITLE_CHARS // 2 else cut
    return whole + "…"
