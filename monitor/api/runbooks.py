"""``GET /runbooks/{name}``: the on-call runbooks of ``alerts/runbooks``, served by the monitor itself.

Every alert the monitor pushes links here (``alerting.runbook_base_url`` points elsewhere when
the runbooks are hosted beside the operator's other docs). Unauthenticated like ``/healthz``: a
runbook holds instructions, never data. Markdown, as written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException
from fastapi import Path as PathParam
from fastapi.responses import PlainTextResponse

from kvcanary import monitor
from kvcanary.monitor.api import statuses

#: The repository's runbooks. They sit beside the ``monitor`` package, like ``migrations/``.
RUNBOOKS_DIR = Path(monitor.__file__).resolve().parent.parent / "alerts" / "runbooks"

router = APIRouter(prefix="/runbooks", tags=["runbooks"])


class MarkdownResponse(PlainTextResponse):
    """A runbook as written: Markdown, in UTF-8."""

    media_type = "text/markdown"


@router.get("", summary="The runbooks there are, one per alert", response_class=PlainTextResponse)
def list_runbooks() -> PlainTextResponse:
    names = sorted(p.stem for p in RUNBOOKS_DIR.glob("*.md"))
    return PlainTextResponse("".join(f"/runbooks/{n}\n" for n in names))


@router.get(
    "/{name}",
    summary="One alert's runbook (Markdown)",
    response_class=MarkdownResponse,
    responses={404: statuses.problem_as_json("No runbook has this name.")},
)
def get_runbook(name: Annotated[str, PathParam(pattern=r"^[A-Za-z0-9]{1,80}$")]) -> MarkdownResponse:
    path = RUNBOOKS_DIR / f"{name}.md"
    if not path.is_file():
        raise HTTPException(status_code=404, detail=f"no runbook named {name!r}")
    return MarkdownResponse(path.read_text(encoding="utf-8"))
