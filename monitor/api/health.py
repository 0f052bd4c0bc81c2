"""``GET /healthz``: unauthenticated liveness for load balancers and Kubernetes.

200 while the database answers, 503 when it does not. The body also carries what the monitor
reports through ``ApiState.health()`` (the scheduler's state, the number of targets).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from monitor.api.schemas import HealthOut
from monitor.api.state import api_state

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    summary="Is the monitor up and its database reachable",
    responses={503: {"model": HealthOut, "description": "The database is unreachable."}},
)
def healthz(request: Request, response: Response) -> HealthOut:
    """Return status ``ok`` (200) when the database answers, ``unhealthy`` (503) when it does not."""
    report = _monitor_report(request)
    if _database_answers(request):
        return HealthOut(status="ok", database="ok", **report)
    response.status_code = 503
    return HealthOut(status="unhealthy", database="unreachable", **report)


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
