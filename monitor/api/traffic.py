"""``/api/v1/traffic``: gateway taps post records here (``POST``); the kept ones are listed (``GET``).

``POST`` takes the API token or the ingest token (``traffic.ingest_token_env``), which can post
traffic and read nothing. The body is read under ``MAX_BODY_BYTES`` (413 past it) and validated
whole before anything is judged: a malformed, oversized or hostile batch gets a 4xx naming the
field, and nothing of it is kept. ``GET`` takes the API token, like every read.
"""

from __future__ import annotations

import hmac
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response, Security, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import Field, ValidationError

from monitor.api.deps import (
    NAME_PATTERN,
    PAGING_HELP,
    PageDep,
    SessionDep,
    TimeRangeDep,
    _bearer,
    cursor_scope,
    encode_cursor,
    token_matches,
)
from monitor.api.schemas import LIMIT_HELP, NEXT_CURSOR_HELP, Problem, _Out
from monitor.api.state import api_state
from monitor.storage import traffic_rows
from monitor.storage.models import Verdict
from monitor.traffic.checks import CHECKS
from monitor.traffic.schema import BATCH_SCHEMA, MAX_BODY_BYTES, read_batch

ingest_router = APIRouter(prefix="/api/v1/traffic", tags=["traffic"])
router = APIRouter(prefix="/traffic", tags=["traffic"])
CheckName = Annotated[
    str, Query(description=f"One of {', '.join(CHECKS)}.", pattern="^(" + "|".join(CHECKS) + ")$")
]


class IngestOut(_Out):
    accepted: int = Field(description="Records judged (their api_base is a configured target's).")
    unmatched: int = Field(description="Records whose api_base is no target's or node's: not judged.")
    own: int = Field(0, description="The monitor's own tenants' records (by key hash): counted, not judged.")
    flagged: int = Field(description="Records a check flagged.")
    rejected: int = Field(0, description="Records refused as malformed (a 422 names their fields).")


class TrafficRecordOut(_Out):
    id: int
    target: str
    node: str
    gateway: str
    request_id: str
    caller: str
    caller_kind: str
    model: str
    started_at: datetime
    received_at: datetime
    status_code: int
    stream: bool
    finish_reason: str | None
    latency_seconds: float | None
    ttft_seconds: float | None
    prompt_chars: int
    prompt_bytes: int
    prompt_messages: int
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    estimated_prompt_tokens: int | None
    kv_pool_tokens: int | None
    verdict: Verdict
    own: bool = Field(description="The monitor's own tenant's request: not judged, kept for blast radii.")
    checks: list[str] = Field(description="The checks that flagged the record.")
    findings: dict[str, Any] = Field(description="Each flagged check's reason and figures.")
    expires_at: datetime


class TrafficPage(_Out):
    items: list[TrafficRecordOut]
    next_cursor: str | None = Field(description=NEXT_CURSOR_HELP)
    limit: int = Field(description=LIMIT_HELP)


def _require_ingest(request: Request, credentials: HTTPAuthorizationCredentials | None) -> None:
    given = credentials.credentials if credentials is not None else ""
    ingest = api_state(request).ingest_token
    if ingest is not None and hmac.compare_digest(given.encode(), ingest.encode()):
        return
    if token_matches(request, given):
        return
    raise HTTPException(
        status.HTTP_401_UNAUTHORIZED, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"}
    )


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"body: over {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"body: over {MAX_BODY_BYTES} bytes")
    return bytes(body)


@ingest_router.post(
    "",
    summary="Post gateway traffic records to be judged",
    status_code=status.HTTP_200_OK,
    response_model=IngestOut,
    responses={401: {"model": Problem}, 413: {"model": Problem}, 503: {"model": Problem}},
    openapi_extra={"requestBody": {"content": {"application/json": {"schema": BATCH_SCHEMA}}}},
)
async def post_traffic(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Response | IngestOut:
    """Judge a batch of records from a gateway tap (``kvcanary.tap``): no text, only summaries."""
    _require_ingest(request, credentials)
    ingest = api_state(request).traffic
    if ingest is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "traffic judging is not running here")
    body = await _body(request)
    try:
        batch, valid = read_batch(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None
    # Another replica handing over its share: judged here, whoever this replica thinks owns it.
    forwarded = "x-kvcanary-forwarded" in request.headers
    answer = IngestOut(**await ingest(batch, valid.records, forwarded), rejected=valid.refused)
    if valid.refused:  # the good records are judged; the tap counts the refused ones and goes on
        content = {"detail": jsonable_encoder(valid.errors), **answer.model_dump()}
        return JSONResponse(content, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
    return answer


@router.get("", summary="List kept traffic records, newest first", description=PAGING_HELP)
def list_traffic(
    session: SessionDep,
    page: PageDep,
    when: TimeRangeDep,
    target: Annotated[str | None, Query(description="Target name.", pattern=NAME_PATTERN)] = None,
    caller: Annotated[
        str | None, Query(description="Caller, as the gateway named it.", max_length=200)
    ] = None,
    check: CheckName | None = None,
    verdict: Annotated[Verdict | None, Query()] = None,
) -> TrafficPage:
    """Return kept records (flagged, or near or over their node's pool); ``since``/``until`` bound
    when each request started."""
    filters = {"target": target, "caller": caller, "check": check, "verdict": verdict}
    scope = cursor_scope("traffic", when, **filters)
    found = traffic_rows.list_traffic(
        session, filters=filters, since=when.since, until=when.until, after=page.after(scope),
        limit=page.limit, offset=page.offset,
    )  # fmt: skip
    items = [
        TrafficRecordOut.model_validate({**row._asdict(), "checks": [c for c in row.checks.split(",") if c]})
        for row in found.rows
    ]
    return TrafficPage(items=items, next_cursor=encode_cursor(found.next_key, scope), limit=page.limit)
