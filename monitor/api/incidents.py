"""``/api/v1/incidents``: list incidents, read one incident's timeline and evidence, and give an
operator's word on a suspected one (confirm it: containment acts; dismiss it as benign: it
resolves), which the containment applies at once (``monitor/containment/``)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request, status

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
    IncidentWordIn,
    ProbeResultOut,
    Problem,
)
from kvcanary.monitor.api.state import api_state
from kvcanary.monitor.containment import NotSuspected
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


_WORD_RESPONSES: dict[int | str, dict[str, object]] = {
    404: {"model": Problem, "description": "No incident has this id."},
    409: {"model": Problem, "description": "It is not an open suspected incident (certain, or resolved)."},
    503: {"model": Problem, "description": "Containment is not running here, or the database is away."},
}


async def _word(request: Request, incident_id: int, body: IncidentWordIn, act: str) -> IncidentOut:
    containment = api_state(request).containment
    if containment is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "containment is not running here")
    try:
        await (containment.confirm if act == "confirm" else containment.dismiss)(incident_id, body.note)
    except NotSuspected as exc:
        code = status.HTTP_404_NOT_FOUND if exc.state is None else status.HTTP_409_CONFLICT
        raise HTTPException(code, str(exc)) from None
    session_factory = api_state(request).session_factory

    def read() -> IncidentOut:
        with session_factory() as session:
            detail = queries.get_incident(session, incident_id=incident_id, results_limit=1)
            assert detail is not None  # it was just changed
            return IncidentOut.of(detail.incident)

    return await asyncio.to_thread(read)


IncidentId = Annotated[int, Path(ge=1, le=MAX_ID)]


@router.post(
    "/{incident_id}/confirm",
    summary="Confirm a suspected incident as a real leak: containment acts on it",
    responses=_WORD_RESPONSES,
)
async def confirm_incident(request: Request, incident_id: IncidentId, body: IncidentWordIn) -> IncidentOut:
    """Make an open ``suspected`` incident ``confirmed``: the quarantine rules act on it as on a
    certain one from this round (an operator's earlier lift notwithstanding); its alert is re-sent
    with the new certainty. A ``confirmed`` event with ``note`` goes in its timeline."""
    return await _word(request, incident_id, body, "confirm")


@router.post(
    "/{incident_id}/dismiss",
    summary="Dismiss a suspected incident as benign: it resolves",
    responses=_WORD_RESPONSES,
)
async def dismiss_incident(request: Request, incident_id: IncidentId, body: IncidentWordIn) -> IncidentOut:
    """Resolve an open ``suspected`` incident as benign (a text the callers share, not a leak); its
    alert ends. A ``dismissed`` event with ``note`` goes in its timeline."""
    return await _word(request, incident_id, body, "dismiss")
