"""``/api/v1/probe-results``: what each probe run concluded, with its measurements and evidence."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from monitor.api.deps import NAME_PATTERN, PageDep, SessionDep, TimeRangeDep
from monitor.api.schemas import ProbeResultOut, ProbeResultPage
from monitor.storage import queries
from monitor.storage.models import Verdict

router = APIRouter(prefix="/probe-results", tags=["probe results"])


@router.get("", summary="List probe results, newest first")
def list_probe_results(
    session: SessionDep,
    page: PageDep,
    when: TimeRangeDep,
    target: Annotated[str | None, Query(description="Target name.", pattern=NAME_PATTERN)] = None,
    probe: Annotated[str | None, Query(description="Probe kind.", pattern=NAME_PATTERN)] = None,
    node: Annotated[str | None, Query(description="Node name.", pattern=NAME_PATTERN)] = None,
    verdict: Annotated[Verdict | None, Query()] = None,
) -> ProbeResultPage:
    """Return a page of results; ``since``/``until`` bound the time each run started."""
    rows, total = queries.list_probe_results(
        session,
        target=target,
        probe=probe,
        node=node,
        verdict=verdict,
        since=when.since,
        until=when.until,
        limit=page.limit,
        offset=page.offset,
    )
    items = [ProbeResultOut.of(row) for row in rows]
    return ProbeResultPage(items=items, total=total, limit=page.limit, offset=page.offset)
