"""The monitor as tests configure and serve it: two configured targets, and the service's own HTTP
app over a test's database.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.run_now import RunNow

RunTarget = Callable[[str], Awaitable[list[dict[str, Any]]]]


def build_app(
    factory: sessionmaker[Session],
    *,
    settings: Settings,
    token: str | None,
    run_target: RunTarget | None = None,
    health: Callable[[], dict[str, Any]] | None = None,
) -> FastAPI:
    """Return the service's own app (``build_http_app``) over ``factory`` and ``settings``."""

    async def no_run(name: str) -> list[dict[str, Any]]:
        raise KeyError(name)

    state = ApiState(
        session_factory=factory,
        api_token=token,
        settings=settings,
        run_now=RunNow(run_target or no_run, min_interval=0),
        health=health or (lambda: {"scheduler": "running"}),
        metrics_page=MonitorMetrics(CollectorRegistry()).exposition,
    )
    return build_http_app(state, title="kvcanary (test)")


def settings_with_targets() -> Settings:
    """Two configured targets; the first has credentials in its URL that must never be served."""
    tenants = [{"name": "alice"}, {"name": "bob"}]
    return Settings.model_validate(
        {
            "targets": [
                {
                    "name": "glm-prod",
                    "base_url": "http://127.0.0.1:30000/v1",
                    "engine": "sglang",
                    "model": "glm-5.3",
                    "tenants": tenants,
                    "probes": ["canary", "cross_tenant"],
                },
                {
                    "name": "llama-dev",
                    "base_url": "http://127.0.0.1:8080",
                    "engine": "llamacpp",
                    "tenants": tenants,
                },
            ]
        }
    )
