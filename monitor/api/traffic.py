"""``/api/v1/traffic``: gateway taps post records here (``POST``); the kept ones are listed (``GET``).

``POST`` takes the API token or the ingest token (``traffic.ingest_token_env``), which can post
traffic and read nothing. Its valid records go into the one traffic pipeline
(``monitor/traffic/ingest.py``): judged here, or published to the stream where
``traffic.source`` is ``jetstream``; a replica that cannot take them now answers 503, and the tap
keeps them. The body is read under ``MAX_BODY_BYTES`` (413 past it) and validated, a record at a
time, off the event loop (``read_off_loop``), before anything is judged: a malformed,
oversized or hostile batch gets a 4xx naming the field, and nothing of it is kept. A 422 names
at most ``MAX_ERRORS`` errors (``MAX_ERRORS_PER_RECORD`` a record) and counts the rest in
``omitted_errors``: its size is bounded whatever the body held. ``GET`` takes the API token, like
every read.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response, Security, status
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import Field, ValidationError

from kvcanary.monitor.api.deps import (
    NAME_PATTERN,
    PAGING_HELP,
    PageDep,
    SessionDep,
    TimeRangeDep,
    _bearer,
    cursor_scope,
    encode_cursor,
    require_ingest,
)
from kvcanary.monitor.api.schemas import LIMIT_HELP, NEXT_CURSOR_HELP, Problem, _Out
from kvcanary.monitor.api.state import api_state
from kvcanary.monitor.metrics.versions import REFUSED_VERSIONS
from kvcanary.monitor.storage import traffic_rows
from kvcanary.monitor.storage.models import TrafficVerdict
from kvcanary.monitor.traffic.checks import CHECKS
from kvcanary.monitor.traffic.ingest import NotTakenHere
from kvcanary.monitor.traffic.pipeline import read_off_loop
from kvcanary.monitor.traffic.reading import MAX_ERRORS, MAX_ERRORS_PER_RECORD, bounded_errors, read_batch
from kvcanary.monitor.traffic.schema import BATCH_SCHEMA, MAX_BODY_BYTES, UnspokenVersion
from kvcanary.wire import SPOKEN_VERSIONS

ingest_router = APIRouter(prefix="/api/v1/traffic", tags=["traffic"])
router = APIRouter(prefix="/traffic", tags=["traffic"])
CheckName = Annotated[
    str, Query(description=f"One of {', '.join(CHECKS)}.", pattern="^(" + "|".join(CHECKS) + ")$")
]


class IngestOut(_Out):
    accepted: int = Field(
        description="Records judged (their api_base is a configured target's); with traffic.source "
        "jetstream, records the stream took, to be judged by the replica holding their partition."
    )
    unmatched: int = Field(description="Records whose api_base is no target's or node's: not judged.")
    own: int = Field(0, description="The monitor's own tenants' records (by key hash): counted, not judged.")
    flagged: int = Field(description="Records a check flagged.")
    rejected: int = Field(0, description="Records refused as malformed (a 422 names their fields).")
    duplicates: int = Field(0, description="Records judged already (a resend): not judged again.")


class FieldError(_Out):
    type: str = Field(description="What is wrong, as pydantic names it (`int_parsing`, `missing`, ...).")
    loc: list[str | int] = Field(description='Where, as a path: `["records", 3, "status"]`.')
    msg: str


class IngestRefusal(_Out):
    """A 422: the batch's envelope (nothing of it judged) or some of its records (the rest judged,
    counted as a 200 counts them) are not what the schema allows."""

    detail: list[FieldError] = Field(
        description=f"The first errors: at most {MAX_ERRORS_PER_RECORD} a record, {MAX_ERRORS} in all."
    )
    omitted_errors: int = Field(description="Errors found and not listed (a floor).")
    accepted: int | None = Field(None, description="With a good envelope: as a 200 says it.")
    unmatched: int | None = Field(None, description="With a good envelope: as a 200 says it.")
    own: int | None = Field(None, description="With a good envelope: as a 200 says it.")
    flagged: int | None = Field(None, description="With a good envelope: as a 200 says it.")
    rejected: int | None = Field(None, description="With a good envelope: the records refused.")
    duplicates: int | None = Field(None, description="With a good envelope: as a 200 says it.")


class VersionRefusal(_Out):
    """A 400: the body is not text, or the batch is of a tap protocol version this monitor does not
    speak (a tap before version 4 sends none): refused whole, never judged, counted in
    ``kvcanary_traffic_version_refused_records_total``. The tap drops the batch and counts it."""

    detail: str = Field(description="Why, naming the version sent and the versions spoken.")
    versions: list[int] | None = Field(
        None, description="The tap protocol versions this monitor speaks (absent: the body is not text)."
    )


class TrafficRecordOut(_Out):
    id: int
    target: str
    node: str
    gateway: str
    request_id: str = Field(
        description="The record's identity: the tap's, one per exchange "
        "(an older tap's record: the gateway's id)."
    )
    upstream_id: str = Field(
        "",
        description="The gateway's id of the response (the engine's, what the customer got); "
        "data, not identity: two records may share it. Empty: the gateway gave none.",
    )
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
    verdict: TrafficVerdict
    own: bool = Field(description="The monitor's own tenant's request: not judged, kept for blast radii.")
    checks: list[str] = Field(description="The checks that flagged the record.")
    findings: dict[str, Any] = Field(
        description="Each flagged check's reason and figures; a refused request's `refused`: what "
        "refused it (`admission`, `quarantine`) and its figures."
    )
    expires_at: datetime


class TrafficPage(_Out):
    items: list[TrafficRecordOut]
    next_cursor: str | None = Field(description=NEXT_CURSOR_HELP)
    limit: int = Field(description=LIMIT_HELP)


async def _body(request: Request) -> bytes:
    """Return the body, read up to ``MAX_BODY_BYTES``; raise 413 past it (declared or sent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"body: over {MAX_BODY_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"body: over {MAX_BODY_BYTES} bytes")
    return b"".join(chunks)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """Return ``schema`` with every ``#/$defs/...`` reference replaced by what it names: in the
    OpenAPI document a ``$ref`` resolves from the document's root, where those defs are not."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {key: walk(value) for key, value in node.items() if key != "$defs"}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    inlined: dict[str, Any] = walk(schema)
    return inlined


@ingest_router.post(
    "",
    summary="Post gateway traffic records to be judged",
    status_code=status.HTTP_200_OK,
    response_model=IngestOut,
    responses={
        400: {
            "model": VersionRefusal,
            "description": "The batch's `version` is not one this monitor speaks, or none (a tap "
            "before version 4): refused whole, `versions` naming those it speaks; or the body is not text.",
        },
        401: {"model": Problem, "description": "Missing or invalid bearer token (ingest or API)."},
        413: {"model": Problem, "description": f"The body is over {MAX_BODY_BYTES} bytes: split it."},
        422: {"model": IngestRefusal, "description": "The batch, or some of its records, are not valid."},
        503: {"model": Problem, "description": "Traffic is not judged here now; send it again later."},
    },
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": _inlined(BATCH_SCHEMA)}}}
    },
)
async def post_traffic(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Response | IngestOut:
    """Judge a batch of records from a gateway tap (``kvcanary.tap``): no text, only summaries.
    Answer 200 with the counts; 400 for a batch of a protocol version this monitor does not speak
    (or none), naming the versions it speaks; 422 naming what is not valid (an envelope: nothing
    judged; records: the rest judged and counted); 413 for a body over ``MAX_BODY_BYTES``; 401
    without the ingest or API token; 503 while this replica does not judge traffic (not running,
    several replicas over HTTP, the stream away, or the database)."""
    require_ingest(request, credentials)
    ingest = api_state(request).traffic
    if ingest is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "traffic judging is not running here")
    body = await _body(request)
    try:
        batch, valid = await read_off_loop(read_batch, body)
    except UnspokenVersion as refusal:  # another version's prints: never this window's
        REFUSED_VERSIONS.add("http", refusal)
        refused = VersionRefusal(detail=str(refusal), versions=list(SPOKEN_VERSIONS))
        return JSONResponse(refused.model_dump(), status_code=status.HTTP_400_BAD_REQUEST)
    except ValidationError as exc:  # the envelope: nothing of the batch is judged
        errors, omitted = bounded_errors(exc)
        content = {"detail": jsonable_encoder(errors), "omitted_errors": omitted}
        return JSONResponse(content, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
    try:
        answer = IngestOut(**await ingest(batch, valid.records), rejected=valid.refused)
    except NotTakenHere as exc:  # the tap keeps the records and sends them again
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc)) from None
    if valid.refused:  # the good records are judged; the tap counts the refused ones and goes on
        content = {"detail": jsonable_encoder(valid.errors), "omitted_errors": valid.omitted}
        content |= answer.model_dump()
        return JSONResponse(content, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
    return answer


@router.get("", summary="List kept traffic records, newest first", description=PAGING_HELP)
def list_traffic(
    session: SessionDep,
    page: PageDep,
    when: TimeRangeDep,
    target: Annotated[str | None, Query(description="Target name.", pattern=NAME_PATTERN)] = None,
    caller: Annotated[
        str | None,
        Query(description="Caller, as the gateway named it.", max_length=200, pattern=r"^[^\x00]*$"),
    ] = None,
    check: CheckName | None = None,
    verdict: Annotated[TrafficVerdict | None, Query()] = None,
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
