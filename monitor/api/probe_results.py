"""``/api/v1/probe-results``: what each probe run concluded, with its measurements and evidence."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from kvcanary.monitor.api import statuses
from kvcanary.monitor.api.deps import (
    NAME_PATTERN,
    PAGING_HELP,
    PageDep,
    SessionDep,
    TimeRangeDep,
    cursor_scope,
    encode_cursor,
)
from kvcanary.monitor.api.schemas import ProbeResultOut, ProbeResultPage
from kvcanary.monitor.storage import queries
from kvcanary.monitor.storage.models import Verdict

router = APIRouter(prefix="/probe-results", tags=["probe results"], responses=statuses.UNAVAILABLE)


@router.get("", summary="List probe results, newest first", description=PAGING_HELP)
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
    scope = cursor_scope("probe-results", when, target=target, probe=probe, node=node, verdict=verdict)
    found = queries.list_probe_results(
        session,
        target=target,
        probe=probe,
        node=node,
        verdict=verdict,
        since=when.since,
        until=when.until,
        after=page.after(scope),
        limit=page.limit,
        offset=page.offset,
    )
    return ProbeResultPage(
        items=[ProbeResultOut.of(row) for row in found.rows],
        next_cursor=encode_cursor(found.next_key, scope),
        limit=page.limit,
    )
