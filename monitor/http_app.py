"""The monitor served over HTTP: ``/api/v1`` (bearer token), ``/healthz`` and ``/metrics``, with the
app's lifespan starting and stopping the monitor, so SIGTERM to ``kvcanary serve`` drains cleanly."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.app import Monitor
from kvcanary.monitor.runs.run_now import RunNow


def create_app(monitor: Monitor, *, start_scheduler: bool = True) -> FastAPI:
    """Return the HTTP app: ``/api/v1`` (bearer token), ``/healthz`` and ``/metrics``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if start_scheduler:
            monitor.start()
        # Everything built at start-up lives as long as the process: keep it out of the collector's
        # full passes, which otherwise stall every request and probe for ~100 ms at scale.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await monitor.stop()

    state = ApiState(
        session_factory=monitor.read_session_factory,
        api_token=monitor.token,
        settings=monitor.settings,
        run_now=RunNow(monitor.runner.run_target, monitor.settings.api.run_now_min_interval_seconds),
        health=monitor.health,
        metrics_page=monitor.metrics.exposition,
        reload=monitor.reload,
        ingest_token=monitor.ingest_token,
        traffic=monitor.traffic,
        judge=monitor.traffic.judge,
        containment=monitor.containment,
    )
    app = build_http_app(state, lifespan=lifespan)
    # Routers read the settings in force: a reload hands them the new ones.
    monitor.on_reload.append(
        lambda new: setattr(app.state, "api", dataclasses.replace(app.state.api, settings=new))
    )
    return app
