"""``GET /healthz``: unauthenticated health for load balancers, Kubernetes and people.

200 while results are being written: the database answers and the last write of results landed.
503 when the database does not answer (``database: unreachable``) or answers reads while writes
fail (``database: unwritable``: a full disk, a primary demoted to read-only, a SQLite file deleted
under the process); results then wait in the spool. The body also carries what the monitor reports
through ``ApiState.health()``: the scheduler's state, the number of targets, the spool, and the
last write (``writes.status``, ``writes.last_success_age_seconds``, ``writes.last_error``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from kvcanary.monitor.api.schemas import HealthOut
from kvcanary.monitor.api.state import api_state

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    summary="Is the monitor up and are its results being written",
    responses={503: {"model": HealthOut, "description": "Results are not being written."}},
)
def healthz(request: Request, response: Response) -> HealthOut:
    """Return status ``ok`` (200) when the database answers, ``unhealthy`` (503) when it does not."""
    report = _monitor_report(request)
    if not _database_answers(request):
        response.status_code = 503
        return HealthOut(status="unhealthy", database="unreachable", **report)
    writes = report.get("writes")
    if isinstance(writes, dict) and writes.get("status") == "failing":
        response.status_code = 503
        return HealthOut(status="unhealthy", database="unwritable", **report)
    return HealthOut(status="ok", database="ok", **report)


def _database_answers(request: Request) -> bool:
    try:
        with api_state(request).session_factory() as session:
            session.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        log.warning("health check: the database does not answer: %s", type(exc).__name__)
        return False
    return True


def _monitor_report(request: Request) -> dict[str, Any]:
    try:
        report = dict(api_state(request).health())
    except Exception:
        log.exception("health check: the health report failed")
        return {"scheduler": "unknown"}
    report.pop("status", None)
    report.pop("database", None)
    return report
