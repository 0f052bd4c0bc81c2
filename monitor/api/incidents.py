"""``/api/v1/incidents``: list incidents and read one incident's timeline and evidence."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query

from kvcanary.monitor.api import statuses
from kvcanary.monitor.api.deps import (
    MAX_ID,
    NAME_PATTERN,
    PAGING_HELP,
    PageDep,
    SessionDep,
    TimeRangeDep,
    cursor_scope,
    encode_cursor,
)
from kvcanary.monitor.api.schemas import (
    IncidentDetailOut,
    IncidentEventOut,
    IncidentOut,
    IncidentPage,
    ProbeResultOut,
    Problem,
)
from kvcanary.monitor.storage import queries
from kvcanary.monitor.storage.models import Severity, State

router = APIRouter(prefix="/incidents", tags=["incidents"], responses=statuses.UNAVAILABLE)


@router.get("", summary="List incidents, newest opened first", description=PAGING_HELP)
def list_incidents(
    session: SessionDep,
    page: PageDep,
    when: TimeRangeDep,
    target: Annotated[str | None, Query(description="Target name.", pattern=NAME_PATTERN)] = None,
    probe: Annotated[str | None, Query(description="Probe kind.", pattern=NAME_PATTERN)] = None,
    node: Annotated[str | None, Query(description="Node name.", pattern=NAME_PATTERN)] = None,
    severity: Annotated[Severity | None, Query()] = None,
    state: Annotated[State | None, Query()] = None,
) -> IncidentPage:
    """Return a page of incidents; ``since``/``until`` bound the time each incident opened."""
    scope = cursor_scope(
        "incidents", when, target=target, probe=probe, node=node, severity=severity, state=state
    )
    found = queries.list_incidents(
        session,
        target=target,
        probe=probe,
        node=node,
        severity=severity,
        state=state,
        since=when.since,
        until=when.until,
        after=page.after(scope),
        limit=page.limit,
        offset=page.offset,
    )
    return IncidentPage(
        items=[IncidentOut.of(row) for row in found.rows],
        next_cursor=encode_cursor(found.next_key, scope),
        limit=page.limit,
    )


@router.get(
    "/{incident_id}",
    summary="One incident: its timeline and the evidence of its linked results",
    responses={404: {"model": Problem, "description": "No incident has this id."}},
)
def get_incident(
    session: SessionDep,
    incident_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    results: Annotated[int, Query(ge=1, le=500, description="How many linked results to return.")] = 50,
) -> IncidentDetailOut:
    """Return the incident, every event oldest first, and its most recent linked probe results."""
    detail = queries.get_incident(session, incident_id=incident_id, results_limit=results)
    if detail is None:
        raise HTTPException(status_code=404, detail=f"incident {incident_id} not found")
    return IncidentDetailOut(
        **IncidentOut.of(detail.incident).model_dump(),
        events=[IncidentEventOut.of(e) for e in detail.events],
        results=[ProbeResultOut.of(r) for r in detail.results],
    )
