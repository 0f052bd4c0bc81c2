"""What the HTTP app's routers read: one typed object, built by the composition root (or a test).

``monitor/app.py`` builds an :class:`ApiState` from the running monitor; the tests build one from a
database and settings of their own. Both hand it to :func:`monitor.api.main.build_http_app`, so the
app a test talks to has every router, page and ``/metrics`` the service has.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from kvcanary.monitor.config.settings import Settings
    from kvcanary.monitor.containment import Containment
    from kvcanary.monitor.runs.run_now import RunNow
    from kvcanary.monitor.traffic.judge import TrafficJudge
    from kvcanary.monitor.traffic.judged_record import TrafficRecord
    from kvcanary.monitor.traffic.schema import TrafficBatch


@dataclass(frozen=True)
class ApiState:
    """The monitor as the HTTP routers see it."""

    #: Read-only sessions: recordings go through the runner's own (writing) sessions.
    session_factory: sessionmaker[Session]
    #: The bearer token of ``/api/v1``; None for a local-only API without auth.
    api_token: str | None
    settings: Settings
    run_now: RunNow
    #: The scheduler's and pipeline's report for ``/healthz``.
    health: Callable[[], dict[str, Any]]
    #: The ``/metrics`` page in the text format.
    metrics_page: Callable[[], bytes]
    #: Reload the configuration (``POST /-/reload``): None when it was taken up, else why not.
    reload: Callable[[str], Awaitable[str | None]] | None = None
    #: The token that may post gateway traffic and read nothing; None: only the API token may.
    ingest_token: str | None = None
    #: Takes a posted batch's valid records (``monitor/traffic/ingest.py``: judged here or published to
    #: the stream; NotTakenHere: a 503); None: traffic is not judged here.
    traffic: Callable[[TrafficBatch, list[TrafficRecord]], Awaitable[dict[str, int]]] | None = None
    #: The traffic judge: what blast radii read of it (the own tenants' key digests, calibration).
    judge: TrafficJudge | None = None
    #: The quarantine set (with the admission guards' facts) and its changes by hand; None: not
    #: served here.
    containment: Containment | None = None


def api_state(request: Request) -> ApiState:
    """Return the state the app serving ``request`` was built with."""
    state: ApiState = request.app.state.api
    return state
