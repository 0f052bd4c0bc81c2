"""Dependencies of the REST routers: a database session, the bearer token, paging and cursors,
time ranges.

Routers read the :class:`~monitor.api.state.ApiState` the app was built with
(``monitor/api/state.py``): the read-only session factory, the API token (None for a local-only
API without auth), the settings, run-now and the health report.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from fastapi import Depends, HTTPException, Query, Request, Security, status
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import TypeAdapter, ValidationError
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.state import api_state
from kvcanary.monitor.storage.db import as_utc
from kvcanary.monitor.storage.queries import Key

MAX_LIMIT = 500


def get_session(request: Request) -> Iterator[Session]:
    """Yield a session for one request; it is closed (and rolled back) afterwards."""
    factory: sessionmaker[Session] = api_state(request).session_factory
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
    """Pass when ``Authorization: Bearer <token>`` matches the app's API token; else raise 401.

    With ``api_token`` None (a local-only API on loopback) every request passes. The comparison
    takes the same time whatever the token, and the token is never echoed or logged.
    """
    if not token_matches(request, credentials.credentials if credentials is not None else ""):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def token_matches(request: Request, given: str) -> bool:
    """Return whether ``given`` is the API token (compared in constant time); always, without one."""
    expected: str | None = api_state(request).api_token
    return expected is None or hmac.compare_digest(given.encode(), expected.encode())


def require_ingest(request: Request, credentials: HTTPAuthorizationCredentials | None) -> None:
    """Pass for the ingest token (what a gateway's tap holds) or the API token; else raise 401."""
    given = credentials.credentials if credentials is not None else ""
    ingest = api_state(request).ingest_token
    if ingest is not None and hmac.compare_digest(given.encode(), ingest.encode()):
        return
    if token_matches(request, given):
        return
    raise HTTPException(
        status.HTTP_401_UNAUTHORIZED, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"}
    )


def known_query(request: Request) -> None:
    """Raise 422 naming each query parameter the operation does not take, each it takes one value
    of but was given several, and each that holds a NUL character.

    ``?severty=critical`` or ``?target=a&target=b`` would otherwise list what the caller did not
    ask for. A NUL is refused whatever the parameter's own rules: PostgreSQL text cannot hold one,
    so no stored name does, and a value holding one would fail the query (a 500) instead of
    matching nothing. An operation that takes no query parameter ignores them.
    """
    dependant: Dependant | None = getattr(request.scope.get("route"), "dependant", None)
    taken = _query_parameters(dependant) if dependant is not None else {}
    if not taken:
        return
    errors = []
    for name in dict.fromkeys(request.query_params.keys()):
        values = request.query_params.getlist(name)
        if name not in taken:
            message = f"unknown parameter; this operation takes {', '.join(sorted(taken))}"
        elif len(values) > 1 and not taken[name]:
            message = f"given {len(values)} times; this operation takes one"
        elif any("\x00" in value for value in values):
            message = "holds a NUL character, which no stored value holds"
        else:
            continue
        given = values[0] if len(values) == 1 else values
        errors.append({"type": "value_error", "loc": ("query", name), "msg": message, "input": given})
    if errors:
        raise RequestValidationError(errors)


def _query_parameters(dependant: Dependant) -> dict[str, bool]:
    """Return the query parameters of ``dependant`` and of what it depends on, each with whether
    it takes several values (a list)."""
    taken: dict[str, bool] = {}
    todo = [dependant]
    while todo:
        current = todo.pop()
        for field in current.query_params:
            taken[field.alias] = _is_list(field.field_info.annotation)
        todo.extend(current.dependencies)
    return taken


def _is_list(annotation: Any) -> bool:
    if get_origin(annotation) in (Union, UnionType):  # Optional[list[str]]
        return any(_is_list(arg) for arg in get_args(annotation))
    return get_origin(annotation) in (list, set, tuple, frozenset)


#: Ids fit PostgreSQL's integer column; larger values are refused with 422, not a 500.
MAX_ID = 2**31 - 1
#: Target names and probe kinds as the config allows them (no NUL, which PostgreSQL refuses).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
#: Any other text a parameter takes: no NUL (``known_query`` says why).
NO_NUL_PATTERN = r"^[^\x00]*$"


#: Offsets above this are refused: skipped rows are still read (their index entries, or the rows
#: themselves for filters no index leads with), so an offset costs more the deeper it goes. A
#: cursor pages to any depth at the cost of the first page.
MAX_OFFSET = 10_000

PAGING_HELP = (
    "Newest first, `id` breaking ties. To page, pass a page's `next_cursor` as `cursor`; "
    "`next_cursor` null means nothing more matches. A page may hold fewer than `limit` items, even "
    "none, when the filters combine in a way no index leads with: follow `next_cursor` until it is "
    "null. A cursor belongs to this list and these filters (`limit` may change between pages). "
    "Items recorded while you page are newer than your cursor: they do not shift or repeat later "
    "pages; start again without a cursor to see them. Results replayed late from the spool keep "
    "their start time and land behind a cursor already past it. There is no total count: the "
    "`kvcanary_*` metrics count runs, verdicts and open incidents. `offset` is kept for old clients, "
    f"up to {MAX_OFFSET:,}; cursors reach any depth at the cost of the first page."
)


@dataclass(frozen=True)
class Paging:
    """The paging parameters of a list request: ``limit``, and where the page starts."""

    limit: int
    offset: int
    cursor: str | None

    def after(self, scope: str) -> Key | None:
        """Return the key the cursor holds (None without one); raise 422 naming ``cursor`` if bad."""
        return None if self.cursor is None else decode_cursor(self.cursor, scope)


def pagination(
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Items per page, 1 to 500.")] = 50,
    cursor: Annotated[
        str | None,
        Query(
            max_length=64,
            pattern=r"^[A-Za-z0-9_-]+$",
            description="The `next_cursor` of the previous page, as given (opaque).",
        ),
    ] = None,
    offset: Annotated[
        int,
        Query(
            ge=0,
            le=MAX_OFFSET,
            deprecated=True,
            description=(
                f"Items to skip, at most {MAX_OFFSET:,}; not with `cursor`. Kept for old clients: "
                "with filters no index leads with (`node`, `probe` alone) every skipped row is read. "
                "Cursors cost the same at any depth."
            ),
        ),
    ] = 0,
) -> Paging:
    """Return the paging parameters; raise 422 naming ``offset`` when it comes with a cursor."""
    if cursor is not None and offset:
        raise _invalid("offset", offset, "offset cannot come with a cursor: the cursor says where to start")
    return Paging(limit, offset, cursor)


PageDep = Annotated[Paging, Depends(pagination)]


# --- cursors -----------------------------------------------------------------------------------------

# A cursor is base64url (no padding) of: version (1 byte), the row's time in microseconds since the
# epoch (8 bytes, signed), its id (4 bytes), then 8 bytes of SHA-256 over the list, its filters and
# those 13 bytes. The digest catches a cursor that was edited, truncated or brought from another
# list or other filters. It is no secret and needs none: a cursor only says where a page starts,
# and anyone who can page can start anywhere by choosing `since`/`until`.
_CURSOR = struct.Struct(">BqI")
_CURSOR_VERSION = 1
_DIGEST_BYTES = 8
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def cursor_scope(resource: str, when: TimeRange, **filters: str | None) -> str:
    """Return the text that binds a cursor to one list and its filters (the given ones only)."""
    given = {name: value for name, value in filters.items() if value is not None}
    given.update({name: at.isoformat() for name, at in vars(when).items() if at is not None})
    return resource + "?" + "&".join(f"{name}={given[name]}" for name in sorted(given))


def encode_cursor(key: Key | None, scope: str) -> str | None:
    """Return the opaque, URL-safe cursor of ``key`` for ``scope``; None for no key (the end)."""
    if key is None:
        return None
    micros = (as_utc(key.at) - _EPOCH) // timedelta(microseconds=1)
    body = _CURSOR.pack(_CURSOR_VERSION, micros, key.id)
    return base64.urlsafe_b64encode(body + _digest(body, scope)).rstrip(b"=").decode("ascii")


def decode_cursor(token: str, scope: str) -> Key:
    """Return the key in ``token``; raise 422 naming ``cursor`` unless :func:`encode_cursor` made it
    for ``scope`` (the same list with the same filters)."""
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise _invalid("cursor", token, "malformed cursor: pass next_cursor as given") from None
    body, digest = raw[: _CURSOR.size], raw[_CURSOR.size :]
    if len(digest) != _DIGEST_BYTES or not hmac.compare_digest(digest, _digest(body, scope)):
        raise _invalid(
            "cursor", token, "invalid cursor: altered, truncated, or from another list or other filters"
        )
    version, micros, row_id = _CURSOR.unpack(body)
    try:
        at = _EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        at = None
    if version != _CURSOR_VERSION or at is None or not 1 <= row_id <= MAX_ID:
        raise _invalid("cursor", token, "invalid cursor: not one this version of kvcanary made")
    return Key(at, row_id)


def _digest(body: bytes, scope: str) -> bytes:
    return hashlib.sha256(b"kvcanary cursor\0" + scope.encode() + b"\0" + body).digest()[:_DIGEST_BYTES]


def _invalid(name: str, value: object, message: str) -> RequestValidationError:
    """Return the 422 FastAPI gives a bad query parameter, naming ``name``."""
    return RequestValidationError(
        [{"type": "value_error", "loc": ("query", name), "msg": message, "input": str(value)}]
    )


@dataclass(frozen=True)
class TimeRange:
    since: datetime | None
    until: datetime | None


#: The times ``since`` and ``until`` take, as the OpenAPI document states them: an ISO-8601 date,
#: or date and time to the minute or finer, with or without an offset. A bare number is refused:
#: read as Unix seconds, ``since=2026`` would mean 33 minutes past the epoch, not the year.
TIME_PATTERN = (
    r"^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"([Tt ]([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,9})?)?"
    r"([Zz]|[+-]([01][0-9]|2[0-3]):?[0-5][0-9])?)?$"
)
_TIME_HELP = (
    "ISO-8601 time, e.g. 2026-11-29T17:00:00Z or 2026-11-29 (no offset: UTC; a date alone: its "
    "midnight; encode '+' as %2B)."
)
_TIME = TypeAdapter(datetime)


def time_range(
    since: Annotated[
        str | None, Query(pattern=TIME_PATTERN, description="From this time, inclusive. " + _TIME_HELP)
    ] = None,
    until: Annotated[
        str | None, Query(pattern=TIME_PATTERN, description="Before this time, exclusive. " + _TIME_HELP)
    ] = None,
) -> TimeRange:
    """Return the range in UTC; raise 422 naming the parameter that is no date (2026-02-30), is out
    of range in UTC, or is later than ``until``."""
    start = _utc_or_422("since", since)
    end = _utc_or_422("until", until)
    if start is not None and end is not None and start > end:
        raise _invalid("since", start.isoformat(), "since must not be later than until")
    return TimeRange(start, end)


TimeRangeDep = Annotated[TimeRange, Depends(time_range)]


def _utc_or_422(name: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return as_utc(_TIME.validate_python(value))
    except ValidationError as exc:
        raise _invalid(name, value, exc.errors()[0]["msg"]) from None
    except OverflowError:  # year 1 at +14:00 or year 9999 at -14:00 has no UTC value
        raise _invalid(name, value, "out of range in UTC") from None
