"""``/api/v1/targets``: the configured targets with their latest verdicts; run one target now."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response

from kvcanary.monitor.api import statuses
from kvcanary.monitor.api.deps import SessionDep
from kvcanary.monitor.api.schemas import (
    LastVerdictOut,
    OpenIncidentOut,
    ProbeRunOut,
    Problem,
    RunOut,
    TargetList,
    TargetOut,
)
from kvcanary.monitor.api.state import api_state
from kvcanary.monitor.runs.run_now import RateLimited, RunJob, RunNow
from kvcanary.monitor.storage import queries
from kvcanary.monitor.storage.models import public_url

router = APIRouter(prefix="/targets", tags=["targets"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "No configured target has this name."}
}


@router.get("", summary="Configured targets and each probe's latest verdict", responses=statuses.UNAVAILABLE)
def list_targets(request: Request, session: SessionDep) -> TargetList:
    """Return every configured target, in order, with the latest verdict of each probe judged so far
    (and the node or path it ran on) and its open incidents, each naming the node or path it came from."""
    targets = api_state(request).settings.targets
    # Only the configured pairs: one index descent each, however many results the table holds.
    last = queries.last_verdicts(session, pairs=[(t.name, probe) for t in targets for probe in t.probes])
    open_incidents = queries.open_incidents_by_target(session, targets=[t.name for t in targets])
    items = []
    for target in targets:
        seen = last.get(target.name, {})
        verdicts = {
            probe: LastVerdictOut(
                verdict=seen[probe][0], started_at=seen[probe][1], reason=seen[probe][2], node=seen[probe][3]
            )
            for probe in target.probes
            if probe in seen
        }
        incidents = [
            OpenIncidentOut(id=i, probe=probe, node=node, severity=severity, opened_at=at, certainty=how)
            for i, probe, node, severity, at, how in open_incidents.get(target.name, [])
        ]
        items.append(
            TargetOut(
                name=target.name,
                engine=target.engine,
                base_url=public_url(target.base_url),
                model=target.model,
                probes=list(target.probes),
                last_verdicts=verdicts,
                open_incidents=incidents,
            )
        )
    return TargetList(items=items)


@router.post(
    "/{name}/run",
    summary="Run every probe of one target now",
    status_code=200,
    responses={
        **_NOT_FOUND,
        202: {
            "model": RunOut,
            "description": "Still running after `wait` seconds: read it at its URL.",
            "headers": {"Location": statuses.header("The run's URL: `GET` it for the verdicts.")},
        },
        429: {
            "model": Problem,
            "description": "Run on request too recently; see Retry-After.",
            "headers": {"Retry-After": statuses.header("Seconds until the target may be run on request.")},
        },
    },
)
async def run_target(
    request: Request,
    response: Response,
    name: Annotated[str, Path(max_length=63)],
    wait: Annotated[float, Query(ge=0, le=120, description="Seconds to wait for the verdicts.")] = 30,
) -> RunOut:
    """Run the target's probes in their configured order; return the verdicts, or 202 while running.

    A run already queued or in flight for the target is joined, not repeated; a target run on
    request less than ``api.run_now_min_interval_seconds`` ago gets 429. The run belongs to the
    monitor: a client that goes away cancels nothing.
    """
    if api_state(request).settings.target(name) is None:
        raise HTTPException(status_code=404, detail=f"target {name!r} is not configured")
    run_now: RunNow = api_state(request).run_now
    try:
        job, _ = run_now.request(name)
    except RateLimited as exc:
        raise HTTPException(
            status_code=429,
            detail=f"{name} was run on request {exc.last.id} moments ago; read it at {_url(exc.last)}",
            headers={"Retry-After": str(math.ceil(exc.retry_after))},
        ) from None
    if not await run_now.wait(job, wait):
        response.status_code = 202
        response.headers["Location"] = _url(job)
    return _run_out(job)


@router.get("/{name}/runs/{run_id}", summary="A run asked for over the API", responses=_NOT_FOUND)
def get_run(
    request: Request,
    name: Annotated[str, Path(max_length=63)],
    run_id: Annotated[str, Path(pattern=r"^[0-9a-f]{12}$")],
) -> RunOut:
    """Return the run's status and, once done, each probe's verdict (the latest runs are kept)."""
    job = api_state(request).run_now.get(name, run_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"no run {run_id} of {name!r} is kept")
    return _run_out(job)


def _url(job: RunJob) -> str:
    return f"/api/v1/targets/{job.target}/runs/{job.id}"


def _run_out(job: RunJob) -> RunOut:
    results = [_run_summary(s) for s in job.results] if job.done else []
    return RunOut(target=job.target, run_id=job.id, status=job.status, results=results, error=job.error)


def _run_summary(summary: dict[str, Any]) -> ProbeRunOut:
    """Return the public part of one runner summary (extra keys are dropped)."""
    return ProbeRunOut.model_validate(
        {
            "probe": summary["probe"],
            "node": summary.get("node") or "",
            "verdict": str(summary["verdict"]),
            "reason": summary["reason"],
            "detail": summary.get("detail") or "",
            "result_id": summary.get("result_id"),
            "incident_id": summary.get("incident_id"),
        }
    )
