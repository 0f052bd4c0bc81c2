"""``GET /incidents/{id}``: the page a person opens from an alert, in plain HTML.

Every alert links here (``monitor/paging/links.py``). The reader is on call, often on a phone, with no
bearer token: a link signed for this incident opens it, and so does the API's bearer token. The
page says what happened and what to do next: the title, severity and state, the figures, the
timeline of every state change (and whether Alertmanager took it), the blast radius (who the fault
exposed, between when and when, with a chart and a disclosure summary), the latest results with
their evidence, and the runbook. It never shows a target's own output: excerpts are left out (marker ids,
hashes, counts and token figures stay), because a link pasted into a chat must not carry another
customer's text; they stay behind the bearer token in the REST API. No script, no CDN, nothing
fetched: the page is whole as served, and asks browsers not to keep it or send its link on.

The markup is a Jinja2 template, ``templates/incident.html``, one block per section, because the
page grows by sections. This module checks the link, then hands the template
text only: autoescaping is on and nothing is marked safe, so whatever the database or an engine
wrote reaches the reader as text, never as markup. Excerpts are dropped here, before the template
sees the evidence.
"""

from __future__ import annotations

import json
import logging
import pathlib
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from kvcanary.monitor.api import statuses
from kvcanary.monitor.api.blast import page_radius
from kvcanary.monitor.api.deps import MAX_ID, SessionDep, token_matches
from kvcanary.monitor.api.evidence_account import account, tells_sizes
from kvcanary.monitor.api.state import api_state
from kvcanary.monitor.blast.chart import chart_of
from kvcanary.monitor.containment.rules import changes_since
from kvcanary.monitor.paging.links import runbook_base, signature_ok
from kvcanary.monitor.paging.pager import ALERTNAMES
from kvcanary.monitor.storage import queries
from kvcanary.monitor.storage.retention import has_excerpts, without_excerpts

router = APIRouter(prefix="/incidents", tags=["pages"])
log = logging.getLogger("kvcanary.api")

#: Results shown: enough to see a pattern (every tenant, every node), few enough to read on a phone.
PAGE_RESULTS = 20
_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",  # the signed link must not travel on to a runbook's host
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
}


@router.get(
    "/{incident_id}",
    summary="The incident page an alert links to (HTML)",
    response_class=HTMLResponse,
    responses={
        403: statuses.problem_as_json("The link does not open this incident (or there is none)."),
        **statuses.UNAVAILABLE_AS_JSON,
    },
)
def incident_page(
    request: Request,
    session: SessionDep,
    incident_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    sig: Annotated[str | None, Query(max_length=64, description="The signature in the alert's link.")] = None,
) -> HTMLResponse:
    # Refused alike whether the incident exists or not, at the same cost: one primary-key read and
    # one HMAC either way, and the incident itself is read only for a link that opens it.
    opened_at = queries.incident_opened_at(session, incident_id)
    allowed = _allowed(request, incident_id, opened_at or _NO_INCIDENT, sig)
    detail = None
    if allowed and opened_at is not None:
        detail = queries.get_incident(session, incident_id=incident_id, results_limit=PAGE_RESULTS)
    if detail is None:
        raise HTTPException(status_code=403, detail=f"this link does not open incident {incident_id}")
    blast, why = _blast(request, session, incident_id)
    quarantine = changes_since(session, detail.incident.target, detail.incident.opened_at)
    page = render(detail, runbook_base(api_state(request).settings), blast, why, quarantine)
    return HTMLResponse(page, headers=_HEADERS)


def _blast(request: Request, session: Any, incident_id: int) -> tuple[dict[str, Any] | None, str]:
    """The blast radius as the page shows it, or None and why it could not be computed (a log file
    unreadable, LiteLLM's database away): the rest of the page is worth having all the same."""
    try:
        radius = page_radius(request, session, incident_id)
    except Exception as exc:  # the page must open whatever a source does
        log.warning("blast radius of incident %s not computed: %s", incident_id, type(exc).__name__)
        return None, f"a source could not be read ({type(exc).__name__})"
    if radius is None:
        return None, "the incident is gone"
    data = radius.as_json()
    data["count"] = (
        data["affected_responses"] if data["affected_responses"] is not None else data["at_risk_responses"]
    )
    return data, ""


#: What a missing incident's signature is checked against, so that its refusal costs what any costs.
_NO_INCIDENT = datetime(1970, 1, 1, tzinfo=UTC)


def _allowed(request: Request, incident_id: int, opened_at: datetime, sig: str | None) -> bool:
    """A link signed for this incident, or the API's bearer token; anything on an API without a token."""
    token = api_state(request).api_token
    # Both checks always run (no early return): which one opened the page must not show in its timing.
    signed = token is not None and signature_ok(token, incident_id, opened_at, sig or "")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return token_matches(request, given if scheme.lower() == "bearer" else "") | signed


def render(
    detail: queries.IncidentDetail,
    runbooks: str,
    blast: dict[str, Any] | None = None,
    blast_error: str = "",
    quarantine: Sequence[Any] = (),
) -> str:
    """Return the whole page for ``detail`` (the incident, its events, its latest results), linking
    to the runbooks under ``runbooks`` as the alerts do; ``blast`` is its blast radius (as JSON),
    ``quarantine`` the target's quarantine changes since it opened."""
    i = detail.incident
    series = (blast or {}).get("series") or {}
    chart = None
    if series and blast is not None:  # drawn over the window, which its last bucket may pass
        end = blast["window"]["end"]
        chart = chart_of(series["counts"], series["start"], series["bucket_seconds"], end)
    return _PAGE.render(
        blast=blast,
        blast_error=blast_error or "no blast radius was asked for",
        chart=chart,
        i=i,
        where=_where(i, detail.results),
        runbooks=runbooks,
        runbook=_runbook(i),
        events=detail.events,
        results=[_shown(r) for r in detail.results],
        page_results=PAGE_RESULTS,
        quarantine=quarantine,
    )


def _runbook(i: Any) -> str | None:
    """The runbook of the alert the incident sends; a suspected leak's says how to verify it."""
    if i.severity == "critical" and i.certainty == "suspected":
        return "KVCanaryLeakSuspected"
    return ALERTNAMES.get(i.severity)


def _where(i: Any, results: Sequence[Any]) -> str:
    """Say where the incident is: its target and probe, and its node, or the prefill x decode pair
    its path runs went down as their evidence names it."""
    where = f"{i.target} / {i.probe}"
    path = next((p for r in results if isinstance(p := (r.evidence or {}).get("path"), dict)), None)
    if path and {"prefill", "decode"} <= path.keys():
        return f"{where} · down prefill {path['prefill']} → decode {path['decode']} ({i.node})"
    return f"{where} @ {i.node}" if i.node else where


def _delivery(e: Any) -> str:
    """Say whether Alertmanager took the event, as the outbox row records it."""
    if e.kind == "config_changed":
        return "not paged (a note on the timeline)"
    if e.processed_at is None:
        waiting = f"not yet ({e.attempts} attempts"
        return waiting + (f"; last: {e.last_error})" if e.last_error else ")")
    if e.last_error:  # set aside after every Alertmanager refused it for good
        return f"never: {e.last_error}"
    return _when(e.processed_at)


@dataclass(frozen=True)
class _Shown:
    """One result as the page shows it. Text only: the template escapes every field."""

    id: int  # its anchor on the page (``#result-ID``)
    started_at: datetime
    verdict: str
    reason: str
    detail: str
    figures: str
    account: list[str]  # the evidence told in a few lines (``evidence_account.py``)
    evidence: str  # the evidence as JSON, excerpts left out; "" when there is none


def _shown(r: Any) -> _Shown:
    """Return what the page shows of result ``r``: its excerpts never reach the template."""
    evidence = r.evidence or {}
    if has_excerpts(evidence):
        evidence = without_excerpts(evidence, "left out of this page")
    shown = json.dumps(evidence, indent=1, sort_keys=True, default=str) if evidence else ""
    told = account(evidence, getattr(r, "target", None))
    figures = _figures(r, tells_sizes(evidence))
    return _Shown(r.id, r.started_at, r.verdict, r.reason, r.detail, figures, told, shown)


def _figures(r: Any, sizes_told: bool) -> str:
    """The result's own figures, less those its evidence's account already says (``sizes_told``)."""
    named = [] if sizes_told else [
        None if r.status_code is None else f"HTTP {r.status_code}",
        None if r.prompt_tokens_sent is None else f"{r.prompt_tokens_sent:,} prompt tokens sent",
        None if r.prompt_tokens_reported is None else f"{r.prompt_tokens_reported:,} reported",
    ]  # fmt: skip
    named.append(None if r.latency_seconds is None else f"latency {r.latency_seconds:.2f} s")
    return " · ".join(figure for figure in named if figure is not None)


#: Unicode categories a page shows as U+FFFD (bidi overrides and isolates, zero-width characters,
#: surrogates, private use): tampering shows, and nothing reorders what the reader sees.
_HIDDEN = frozenset({"Cf", "Cs", "Co"})


def _printable(value: Any) -> Any:
    """Return what a template writes for ``value``: a string with no control, bidi or zero-width
    character (newlines and tabs kept; others become a space or U+FFFD), anything else as it is.
    Names are made printable where they enter (the traffic schema, ``probes.untrusted``); this is
    the last guard, for rows stored before that and for whatever a later source forgets."""
    if not isinstance(value, str) or value.isprintable():
        return value
    return "".join(
        c if c.isprintable() or c in "\n\t" else "\ufffd" if unicodedata.category(c) in _HIDDEN else " "
        for c in value
    )


def _when(moment: Any) -> str:
    """One format for every time on the page, whether it came as a datetime or as ISO text (the
    blast radius's JSON): to the second, in UTC."""
    if isinstance(moment, str):
        try:
            moment = datetime.fromisoformat(moment)
        except ValueError:
            return str(moment)
    if moment is None:
        return ""
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return str(moment.strftime("%Y-%m-%d %H:%M:%S UTC"))


#: Loaded once, at import (a missing template fails the import, not a page). Autoescaping is on
#: for every template whatever its name, and an unknown name in a template is an error, not "".
_TEMPLATES = Environment(
    loader=FileSystemLoader(pathlib.Path(__file__).resolve().parent / "templates"),
    autoescape=True,
    finalize=_printable,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_TEMPLATES.filters.update(when=_when, delivery=_delivery)
_PAGE = _TEMPLATES.get_template("incident.html")
