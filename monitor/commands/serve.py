"""``kvcanary serve``: the monitor as a long-running HTTP service."""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from monitor.app import Monitor, create_app
from monitor.config.settings import Settings

log = logging.getLogger("kvcanary")


def serve_forever(settings: Settings) -> None:
    """Run the scheduler, REST API and /metrics until SIGTERM/SIGINT.

    Raises ConfigError (missing secrets) or DatabaseNotMigrated before anything listens.
    """
    monitor = Monitor(settings)
    app = create_app(monitor)
    api = settings.api
    log.info(
        "kvcanary serving %d target(s) on http://%s (api token: %s)",
        len(settings.targets),
        api.listen,
        "required" if monitor.token else "none, local-only",
    )
    grace = api.shutdown_grace_seconds
    config = uvicorn.Config(
        app,
        host=api.host,
        port=api.port,
        log_level="warning",
        lifespan="on",
        # Requests still open after the grace (a run-now waiting on a hung target) are cut, not awaited.
        timeout_graceful_shutdown=max(1, round(grace)),
    )
    _Server(config, monitor).run()


class _Server(uvicorn.Server):
    """uvicorn's server, telling the monitor the moment a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, monitor: Monitor):
        super().__init__(config)
        self._monitor = monitor

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Stop scheduling at once: uvicorn first waits for open requests, and probes must not go on.
        self._monitor.begin_shutdown()
        super().handle_exit(sig, frame)
