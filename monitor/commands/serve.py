"""``kvcanary serve``: the monitor as a long-running HTTP service."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
from pathlib import Path
from types import FrameType

import uvicorn

from kvcanary.monitor.app import Monitor
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.http_app import create_app

log = logging.getLogger("kvcanary")


def serve_forever(settings: Settings, config_path: Path | None = None) -> None:
    """Run the scheduler, REST API and /metrics until SIGTERM/SIGINT; SIGHUP reloads ``config_path``.

    Raises ConfigError (a secret missing, NATS not reached), DatabaseNotMigrated or DatabaseInUse
    before anything listens (``Monitor.open``).
    """
    # Until the loop's own handler is in place (startup), a SIGHUP must not end the process.
    signal.signal(signal.SIGHUP, lambda *_: log.warning("SIGHUP while starting: ignored; send it again"))
    monitor = Monitor.open(settings, config_path=config_path)
    _raise_open_file_limit(monitor.http.max_connections + 256)  # the pool, the database, the API
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


def _raise_open_file_limit(wanted: int) -> None:
    """Raise the soft limit on open files towards ``wanted`` (as Go programs such as Prometheus do):
    the common default of 1,024 is below what the connection pool may hold with many hung targets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            log.warning(
                "open files limited to %d (hard limit); %d may be needed: raise LimitNOFILE", new, wanted
            )


class _Server(uvicorn.Server):
    """uvicorn's server, telling the monitor the moment a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, monitor: Monitor):
        super().__init__(config)
        self._monitor = monitor

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # SIGHUP reloads the configuration, as Prometheus and Alertmanager do (systemd's ExecReload,
        # logrotate's postrotate send it); without a handler it would end the process.
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self._monitor.reload("SIGHUP")))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Stop scheduling at once: uvicorn first waits for open requests, and probes must not go on.
        self._monitor.begin_shutdown()
        super().handle_exit(sig, frame)
