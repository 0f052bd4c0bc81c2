"""``GET /api/v1/incidents/{id}/blast-radius``: who an incident exposed, between when and when.

Read from the sources the configuration names (``blast_radius`` in the settings): the traffic
the monitor recorded, the gateway's log files, LiteLLM's spend log. A request cannot name other
files or databases: the API reads only what its operator configured. ``exclude`` adds callers to
leave out (the reporter, a test account) to those the configuration lists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from pydantic import StringConstraints
from sqlalchemy.orm import Session

from kvcanary.monitor.api import statuses
from kvcanary.monitor.api.deps import MAX_ID, NO_NUL_PATTERN, SessionDep
from kvcanary.monitor.api.schemas import Problem
from kvcanary.monitor.api.state import api_state
from kvcanary.monitor.blast.compute import BlastSources, blast_radius, configured_sources
from kvcanary.monitor.blast.report import BlastRadius
from kvcanary.monitor.config.secrets import tenant_keys
from kvcanary.monitor.config.settings import ConfigError, Settings
from kvcanary.monitor.traffic.judge import TrafficJudge, own_key_digests

router = APIRouter(prefix="/incidents", tags=["incidents"], responses=statuses.UNAVAILABLE)

Caller = Annotated[str, StringConstraints(max_length=200, pattern=NO_NUL_PATTERN)]


def sources_of(settings: Settings, judge: TrafficJudge | None, exclude: Sequence[str] = ()) -> BlastSources:
    """What this monitor reads for a blast radius: its configured sources, its own tenants' key
    digests, and the traffic judge's calibration of each target."""
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

    return configured_sources(
        settings, own_keys=frozenset(own), chars_per_token=chars_per_token, exclude=exclude
    )


def radius_of(request: Request, session: Session, incident_id: int, exclude: list[str]) -> BlastRadius | None:
    state = api_state(request)
    return blast_radius(
        session, incident_id, state.settings, sources_of(state.settings, state.judge, exclude)
    )


#: Seconds the incident page reuses a blast radius: a signed link opened again and again (a chat
#: of responders) must not rescan a gateway's logs each time.
PAGE_CACHE_SECONDS = 60.0
PAGE_CACHE_ENTRIES = 256


class PageCache:
    """The blast radii the incident page shows, each computed once a ``PAGE_CACHE_SECONDS`` however
    many views arrive together (one computation per incident at a time; the others wait for it).
    Made with the app (``monitor/api/main.py``); the page handlers run in the threadpool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[int, tuple[float, BlastRadius | None]] = {}
        self._computing: dict[int, threading.Lock] = {}

    def get(self, incident_id: int, compute: Callable[[], BlastRadius | None]) -> BlastRadius | None:
        with self._lock:
            one = self._computing.setdefault(incident_id, threading.Lock())
        with one:
            kept = self._kept.get(incident_id)
            if kept is not None and time.monotonic() - kept[0] < PAGE_CACHE_SECONDS:
                return kept[1]
            radius = compute()
            with self._lock:
                if len(self._kept) >= PAGE_CACHE_ENTRIES:
                    self._kept.clear()
                    self._computing = {incident_id: one}
                self._kept[incident_id] = (time.monotonic(), radius)
            return radius


def page_radius(request: Request, session: Session, incident_id: int) -> BlastRadius | None:
    """The blast radius the incident page shows (``PageCache``)."""
    cache: PageCache = request.app.state.blast_cache
    return cache.get(incident_id, lambda: radius_of(request, session, incident_id, []))


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
