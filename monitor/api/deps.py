"""Dependencies of the REST routers: a database session, the bearer token, pagination, time ranges.

Routers read what the composition root (``monitor/app.py``) put on ``app.state``:
``session_factory`` (a sessionmaker), ``api_token`` (``str``, or None for a local-only API
without auth), ``settings``, ``run_target`` and ``health``.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import Depends, HTTPException, Query, Request, Security, status
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from monitor.storage.db import as_utc

MAX_LIMIT = 500


def get_session(request: Request) -> Iterator[Session]:
    """Yield a session for one request; it is closed (and rolled back) afterwards."""
    factory: sessionmaker[Session] = request.app.state.session_factory
    with factory() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]

_bearer = HTTPBearer(
    auto_error=False,
    description="The API token configured by api.token_env or api.token_file.",
)


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
) -> None:
    """Pass when ``Authorization: Bearer <token>`` matches ``app.state.api_token``; else raise 401.

    With ``api_token`` None (a local-only API on loopback) every request passes. The comparison
    takes the same time whatever the token, and the token is never echoed or logged.
    """
    expected: str | None = request.app.state.api_token
    if expected is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


#: Ids and offsets fit PostgreSQL's integer column; larger values are refused with 422, not a 500.
MAX_ID = 2**31 - 1
#: Target names and probe kinds as the config allows them (no NUL, which PostgreSQL refuses).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


@dataclass(frozen=True)
class Page:
    limit: int
    offset: int


def pagination(
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Items per page, 1 to 500.")] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_ID, description="Items to skip.")] = 0,
) -> Page:
    return Page(limit, offset)


PageDep = Annotated[Page, Depends(pagination)]


@dataclass(frozen=True)
class TimeRange:
    since: datetime | None
    until: datetime | None


_TIME_HELP = "ISO-8601 time, e.g. 2026-11-29T17:00:00Z (no offset: UTC; encode '+' as %2B)."


def time_range(
    since: Annotated[datetime | None, Query(description="From this time, inclusive. " + _TIME_HELP)] = None,
    until: Annotated[datetime | None, Query(description="Before this time, exclusive. " + _TIME_HELP)] = None,
) -> TimeRange:
    """Return the range in UTC; raise 422 naming the parameter that is out of range or reversed."""
    since = _utc_or_422("since", since)
    until = _utc_or_422("until", until)
    if since is not None and until is not None and since > until:
        raise RequestValidationError(
            [
                {
                    "type": "value_error",
                    "loc": ("query", "since"),
                    "msg": "since must not be later than until",
                    "input": since.isoformat(),
                }
            ]
        )
    return TimeRange(since, until)


TimeRangeDep = Annotated[TimeRange, Depends(time_range)]


def _utc_or_422(name: str, value: datetime | None) -> datetime | None:
    if value is None:
        return None
    try:
        return as_utc(value)
    except OverflowError:  # year 1 at +14:00 or year 9999 at -14:00 has no UTC value
        raise RequestValidationError(
            [
                {
                    "type": "value_error",
                    "loc": ("query", name),
                    "msg": "out of range in UTC",
                    "input": str(value),
                }
            ]
        ) from None
