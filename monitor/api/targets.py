"""``/api/v1/targets``: the configured targets with their latest verdicts; run one target now."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request

from monitor.api.deps import SessionDep
from monitor.api.schemas import LastVerdictOut, ProbeRunOut, Problem, RunOut, TargetList, TargetOut
from monitor.storage import queries
from monitor.storage.models import public_url

router = APIRouter(prefix="/targets", tags=["targets"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "No configured target has this name."}
}


@router.get("", summary="Configured targets and each probe's latest verdict")
def list_targets(request: Request, session: SessionDep) -> TargetList:
    """Return every configured target, in order, with the latest verdict of each probe judged so far."""
    targets = request.app.state.settings.targets
    # Only the configured pairs: one index descent each, however many results the table holds.
    last = queries.last_verdicts(session, pairs=[(t.name, probe) for t in targets for probe in t.probes])
    items = []
    for target in targets:
        seen = last.get(target.name, {})
        verdicts = {
            probe: LastVerdictOut.model_validate(
                {"verdict": seen[probe][0], "started_at": seen[probe][1], "reason": seen[probe][2]}
            )
            for probe in target.probes
            if probe in seen
        }
        items.append(
            TargetOut(
                name=target.name,
                engine=target.engine,
                base_url=public_url(target.base_url),
                model=target.model,
                probes=list(target.probes),
                last_verdicts=verdicts,
            )
        )
    return TargetList(items=items)


@router.post("/{name}/run", summary="Run every probe of one target now", responses=_NOT_FOUND)
async def run_target(request: Request, name: Annotated[str, Path(max_length=63)]) -> RunOut:
    """Run the target's probes in their configured order and return each verdict once recorded."""
    if request.app.state.settings.target(name) is None:
        raise HTTPException(status_code=404, detail=f"target {name!r} is not configured")
    try:
        summaries: list[dict[str, Any]] = await request.app.state.run_target(name)
    except KeyError:
        raise HTTPException(status_code=404, detail=f"target {name!r} is not configured") from None
    return RunOut(target=name, results=[_run_summary(s) for s in summaries])


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
