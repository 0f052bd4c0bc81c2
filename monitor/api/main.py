"""The HTTP app: ``/api/v1`` (bearer token), ``/healthz``, ``/runbooks``, the incident page, ``/docs``
and ``/metrics``, all reading one :class:`~monitor.api.state.ApiState`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Lifespan

from kvcanary.monitor.api import (
    blast,
    containment,
    health,
    incidents,
    outage,
    pages,
    probe_results,
    runbooks,
    statuses,
    targets,
    traffic,
)
from kvcanary.monitor.api.deps import known_query, require_token
from kvcanary.monitor.api.docs import serve_docs
from kvcanary.monitor.api.schemas import Problem, ReloadOut
from kvcanary.monitor.api.state import ApiState, api_state

api_router = APIRouter(
    prefix="/api/v1",
    dependencies=[Depends(require_token), Depends(known_query)],
    responses=statuses.UNAUTHORIZED,
)
api_router.include_router(incidents.router)
api_router.include_router(blast.router)
api_router.include_router(containment.router)
api_router.include_router(probe_results.router)
api_router.include_router(targets.router)
api_router.include_router(traffic.router)


def build_http_app(
    state: ApiState, *, lifespan: Lifespan[FastAPI] | None = None, title: str = "kvcanary"
) -> FastAPI:
    """Return the app serving ``state``: every router, the incident page, the runbooks and ``/metrics``."""
    app = FastAPI(
        title=title,
        version="0.1.0",
        description="Canary probes for KV-cache isolation: incidents, probe results and targets.",
        lifespan=lifespan,
        docs_url=None,  # served from local assets below, not a CDN
        redoc_url=None,
    )
    serve_docs(app)
    outage.install(app)
    app.state.api = state
    app.state.blast_cache = blast.PageCache()  # the incident page's blast radii
    app.include_router(health.router)
    app.include_router(traffic.ingest_router)  # its own auth: the ingest token may post
    app.include_router(containment.set_router)  # its own auth: the ingest token may read it
    app.include_router(api_router)
    app.include_router(runbooks.router)
    app.include_router(pages.router)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(state.metrics_page(), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/-/reload",
        dependencies=[Depends(require_token)],
        summary="Reload the configuration file (as SIGHUP does)",
        response_model=ReloadOut,
        responses={
            400: {"model": Problem, "description": "The file was refused; the one in force stays."},
            **statuses.UNAUTHORIZED,
            # A reload writes the targets it names.
            **statuses.UNAVAILABLE,
        },
        tags=["health"],
    )
    async def reload(request: Request) -> ReloadOut | JSONResponse:
        run = api_state(request).reload
        refused = (
            "this app has no configuration file to reload" if run is None else await run("POST /-/reload")
        )
        if refused:
            return JSONResponse({"detail": refused}, status_code=400)
        return ReloadOut(status="reloaded")

    statuses.install(app)
    return app
