"""``GET /incidents/{id}``: the page a person opens from an alert, in plain HTML.

Every alert links here (``monitor/paging/links.py``). The reader is on call, often on a phone, with no
bearer token: a link signed for this incident opens it, and so does the API's bearer token. The
page says what happened and what to do next: the title, severity and state, the figures, the
timeline of every state change (and whether Alertmanager took it), the latest results with their
evidence, and the runbook. It never shows a target's own output: excerpts are left out (marker ids,
hashes, counts and token figures stay), because a link pasted into a chat must not carry another
customer's text; they stay behind the bearer token in the REST API. No script, no CDN, nothing
fetched: the page is whole as served, and asks browsers not to keep it or send its link on.
"""

from __future__ import annotations

import json
from datetime import datetime
from html import escape
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse

from monitor.api.deps import MAX_ID, SessionDep, token_matches
from monitor.paging.links import runbook_base, signature_ok
from monitor.paging.pager import ALERTNAMES
from monitor.storage import queries
from monitor.storage.retention import has_excerpts, without_excerpts

router = APIRouter(prefix="/incidents", tags=["pages"])

#: Results shown: enough to see a pattern (every tenant, every node), few enough to read on a phone.
PAGE_RESULTS = 20
_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",  # the signed link must not travel on to a runbook's host
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
}
_STYLE = " ".join(
    [
        "body{font:15px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:62em;padding:0 1em}",
        "h1{font-size:1.35em;margin:.2em 0} h2{font-size:1.1em;margin-top:1.6em}",
        "table{border-collapse:collapse;width:100%}",
        "td,th{border-bottom:1px solid #ddd;padding:.3em .5em;text-align:left;vertical-align:top}",
        "th{font-weight:600;white-space:nowrap}",
        ".badge{border-radius:.3em;padding:.1em .5em;color:#fff;font-weight:600}",
        ".critical{background:#b3261e} .high{background:#c25e00} .warning{background:#7a6a00}",
        ".resolved{background:#2e7d32} .open{background:#444}",
        "pre{background:#f5f5f5;padding:.6em;overflow-x:auto;font-size:13px;margin:.3em 0} .note{color:#555}",
    ]
)


@router.get(
    "/{incident_id}",
    summary="The incident page an alert links to (HTML)",
    response_class=HTMLResponse,
    responses={403: {"description": "The link does not open this incident (or there is none)."}},
)
def incident_page(
    request: Request,
    session: SessionDep,
    incident_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    sig: Annotated[str | None, Query(max_length=64, description="The signature in the alert's link.")] = None,
) -> HTMLResponse:
    detail = queries.get_incident(session, incident_id=incident_id, results_limit=PAGE_RESULTS)
    # Refused alike whether the incident exists or not: a link opens its own incident, nothing else.
    if detail is None or not _allowed(request, incident_id, detail.incident.opened_at, sig):
        raise HTTPException(status_code=403, detail=f"this link does not open incident {incident_id}")
    return HTMLResponse(render(detail, runbook_base(request.app.state.settings)), headers=_HEADERS)


def _allowed(request: Request, incident_id: int, opened_at: datetime, sig: str | None) -> bool:
    """A link signed for this incident, or the API's bearer token; anything on an API without a token."""
    token: str | None = request.app.state.api_token
    if token is not None and sig is not None and signature_ok(token, incident_id, opened_at, sig):
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return token_matches(request, given if scheme.lower() == "bearer" else "")


def render(detail: queries.IncidentDetail, runbooks: str) -> str:
    """Return the whole page for ``detail`` (the incident, its events, its latest results), linking
    to the runbooks under ``runbooks`` as the alerts do."""
    i = detail.incident
    where = f"{i.target} / {i.probe}" + (f" @ {i.node}" if i.node else "")
    runbook = ALERTNAMES.get(i.severity)
    parts = [
        f"<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<meta name=viewport content='width=device-width,initial-scale=1'>"
        f"<title>Incident {i.id}: {escape(i.title)}</title><style>{_STYLE}</style></head><body>",
        f"<p>{_badge(i.severity)} {_badge(i.state)} incident {i.id} · {escape(where)}</p>",
        f"<h1>{escape(i.title)}</h1>",
        _facts(i),
        f"<p><a href='{escape(runbooks)}/{runbook}'>Runbook: what to do now</a></p>" if runbook else "",
        "<h2>Timeline</h2>",
        _timeline(detail.events),
        f"<h2>Latest results (up to {PAGE_RESULTS})</h2>",
        _results(detail.results),
        "<p class=note>Excerpts of what targets answered are not shown on this page: read them through "
        f"<code>GET /api/v1/incidents/{i.id}</code> with the API token.</p></body></html>",
    ]
    return "".join(parts)


def _facts(i: Any) -> str:
    rows = [
        ("Opened", _when(i.opened_at)),
        ("Last failure", _when(i.last_failure_at)),
        ("Resolved", _when(i.resolved_at) if i.resolved_at else "not yet"),
        ("Failures counted", str(i.failure_count)),
        ("Passes in a row since it", str(i.consecutive_passes)),
        ("Last result", f"{i.last_verdict} ({i.last_reason})"),
    ]
    return _table(None, [[f"<b>{escape(k)}</b>", escape(v)] for k, v in rows])


def _timeline(events: list[Any]) -> str:
    rows = [
        [
            escape(_when(e.created_at)),
            escape(e.kind),
            escape(f"{e.old_state or '-'} → {e.new_state}"),
            escape(f"{e.old_severity or '-'} → {e.new_severity}"),
            escape(f"{e.verdict or ''} {f'({e.reason})' if e.reason else ''}"),
            escape(_delivery(e)),
        ]
        for e in events
    ]
    return _table(["When", "Event", "State", "Severity", "Result", "Alertmanager took it"], rows)


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


def _results(results: list[Any]) -> str:
    if not results:
        return "<p class=note>No result is linked to this incident any more (pruned).</p>"
    rows = []
    for r in results:
        evidence = r.evidence or {}
        if has_excerpts(evidence):
            evidence = without_excerpts(evidence, "left out of this page")
        figures = _figures(r)
        rows.append(
            [
                escape(_when(r.started_at)),
                f"<b>{escape(r.verdict)}</b><br>{escape(r.reason)}",
                escape(r.detail) + (f"<br><span class=note>{escape(figures)}</span>" if figures else ""),
                f"<pre>{escape(json.dumps(evidence, indent=1, sort_keys=True, default=str))}</pre>"
                if evidence
                else "",
            ]
        )
    return _table(["Started", "Verdict", "What it found", "Evidence (redacted)"], rows)


def _figures(r: Any) -> str:
    named = [
        ("HTTP", r.status_code),
        ("prompt tokens sent", r.prompt_tokens_sent),
        ("reported", r.prompt_tokens_reported),
        ("latency s", None if r.latency_seconds is None else f"{r.latency_seconds:.2f}"),
    ]
    return " · ".join(f"{name} {value}" for name, value in named if value is not None)


def _table(head: list[str] | None, rows: list[list[str]]) -> str:
    """Return an HTML table; cells are HTML already (escaped by the caller), headings are text."""
    top = "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>" if head else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{top}{body}</table>"


def _badge(word: str) -> str:
    return f"<span class='badge {escape(word)}'>{escape(word)}</span>"


def _when(moment: Any) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC") if moment is not None else ""
