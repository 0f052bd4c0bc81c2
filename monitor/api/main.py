"""The REST API's routers: ``api_router`` (``/api/v1``, bearer token) and ``health_router``."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from monitor.api import health, incidents, probe_results, targets
from monitor.api.deps import require_token
from monitor.api.schemas import Problem

api_router = APIRouter(
    prefix="/api/v1",
    dependencies=[Depends(require_token)],
    responses={401: {"model": Problem, "description": "Missing or invalid bearer token."}},
)
api_router.include_router(incidents.router)
api_router.include_router(probe_results.router)
api_router.include_router(targets.router)

health_router = health.router
