"""``GET /api/v1/incidents/{id}/blast-radius``: who an incident exposed, between when and when.

Read from the sources the configuration names (``blast_radius`` in the settings): the traffic
the monitor recorded, the gateway's log files, LiteLLM's spend log. A request cannot name other
files or databases: the API reads only what its operator configured. ``exclude`` adds callers to
leave out (the reporter, a test account) to those the configuration lists.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from pydantic import StringConstraints
from sqlalchemy.orm import Session

from monitor.api.deps import MAX_ID, SessionDep
from monitor.api.schemas import Problem
from monitor.api.state import ApiState, api_state
from monitor.blast.compute import BlastSources, blast_radius
from monitor.blast.report import BlastRadius
from monitor.config.secrets import litellm_db_url, tenant_keys
from monitor.config.settings import ConfigError
from monitor.traffic.judge import own_key_digests

router = APIRouter(prefix="/incidents", tags=["incidents"])

Caller = Annotated[str, StringConstraints(max_length=200)]


def sources_of(state: ApiState, exclude: list[str] = ()) -> BlastSources:  # type: ignore[assignment]
    """What this monitor reads for a blast radius: its configured sources, its own tenants' key
    digests, and the traffic judge's calibration of each target."""
    settings = state.settings
    judge = state.judge
    if judge is not None:
        own = judge.own_keys
    else:
        try:
            own = own_key_digests(tenant_keys(settings))
        except ConfigError:
            own = frozenset()

    def chars_per_token(target: str) -> float | None:
        client = judge.facts.clients.get(target) if judge is not None else None
        calibration = getattr(client, "calibration", None)
        return None if calibration is None else calibration.chars_per_token

    return BlastSources(
        logs=tuple((log.path, log.format) for log in settings.blast_radius.logs),
        litellm_db=litellm_db_url(settings),
        exclude=tuple(dict.fromkeys([*settings.blast_radius.exclude_callers, *exclude])),
        own_keys=frozenset(own),
        chars_per_token=chars_per_token,
    )


def radius_of(request: Request, session: Session, incident_id: int, exclude: list[str]) -> BlastRadius | None:
    return blast_radius(
        session, incident_id, api_state(request).settings, sources_of(api_state(request), exclude)
    )


@router.get(
    "/{incident_id}/blast-radius",
    summary="Who an incident exposed: the responses, their callers, the window, and how it was computed",
    responses={404: {"model": Problem, "description": "No incident has this id."}},
)
def get_blast_radius(
    request: Request,
    session: SessionDep,
    incident_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    exclude: Annotated[
        list[Caller], Query(max_length=100, description="A caller to leave out and count apart (repeatable).")
    ] = [],  # noqa: B006 (FastAPI copies query defaults)
) -> dict[str, Any]:
    """Return ``window``, ``criterion``, ``affected_responses`` (or ``at_risk_responses``),
    ``callers`` (``{caller, responses, first, last}``), ``excluded``, ``sources`` and the
    disclosure summary. Counts are null where no source covers the window: unknown, not zero."""
    radius = radius_of(request, session, incident_id, exclude)
    if radius is None:
        raise HTTPException(status_code=404, detail=f"incident {incident_id} not found")
    return jsonable_encoder(radius.as_json())  # type: ignore[no-any-return]
