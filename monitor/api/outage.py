"""The REST API during a database outage: 503 with ``Retry-After``, one log line per outage.

Without this, every request while PostgreSQL was down ended in a 500 with a full traceback
(1,051 responses and 13.9 MB of log in 30 s). A database that cannot be reached is not a bug in
the monitor: clients get ``503 {"detail": ...}`` and retry; the log says once when the outage
began (the first error's type and first line) and once when an API request succeeded again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

log = logging.getLogger("kvcanary.api")
Endpoint = Callable[[Request], Awaitable[Response]]

#: What a client is told to wait before asking again.
RETRY_AFTER_SECONDS = 5
#: Routes whose 2xx means the database answered a query (run-now answers from memory).
READ_PATHS = ("/api/v1/incidents", "/api/v1/probe-results", "/incidents/")
#: Errors that mean the database cannot answer now (down, restarting, locked, pool exhausted).
UNAVAILABLE = (OperationalError, DisconnectionError, PoolTimeout)


class OutageLog:
    """Says once when API requests began to fail on the database, and once when they stopped."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.failed = 0

    def failure(self, exc: Exception) -> None:
        self.failed += 1
        if self.since is None:
            self.since = time.monotonic()
            first = str(getattr(exc, "orig", exc)).strip().splitlines()[:1]
            log.warning(
                "the database does not answer API requests (%s: %s); answering 503 until it does",
                type(exc).__name__,
                first[0][:200] if first else "",
            )

    def success(self) -> None:
        if self.since is not None:
            log.warning(
                "the database answers API requests again after %.0fs (%d answered 503)",
                time.monotonic() - self.since,
                self.failed,
            )
            self.since, self.failed = None, 0


def _is_unavailable(exc: Exception) -> bool:
    return isinstance(exc, UNAVAILABLE) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def install(app: FastAPI) -> OutageLog:
    """Answer 503 for database outages on every route of ``app``; return the outage log it keeps."""
    outage = OutageLog()

    async def unavailable(request: Request, exc: Exception) -> Response:
        if not _is_unavailable(exc):
            raise exc
        outage.failure(exc)
        return JSONResponse(
            {"detail": "the database is unavailable; retry later"},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )

    app.add_exception_handler(DBAPIError, unavailable)
    app.add_exception_handler(DisconnectionError, unavailable)
    app.add_exception_handler(PoolTimeout, unavailable)

    @app.middleware("http")
    async def note_recovery(request: Request, call_next: Endpoint) -> Response:
        response = await call_next(request)
        # Only routes that read the database say it is back (not /runbooks, /docs or a run-now).
        read = 200 <= response.status_code < 300
        if read and request.method == "GET" and request.url.path.startswith(READ_PATHS):
            outage.success()
        return response

    return outage
