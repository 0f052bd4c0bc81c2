"""``kvcanary serve``: the monitor as a long-running HTTP service."""

from __future__ import annotations

import logging

import uvicorn

from monitor.app import Monitor, create_app
from monitor.config import Settings

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
    # uvicorn turns SIGTERM into a graceful shutdown; the app's lifespan then stops the scheduler.
    uvicorn.run(app, host=api.host, port=api.port, log_level="warning", lifespan="on")
