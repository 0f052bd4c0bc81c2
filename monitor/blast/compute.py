"""Compute an incident's blast radius: the question from its rows, then every source's answer.

``BlastSources`` holds the list of sources to read (``source.BlastSource``: the monitor's own
traffic, and where configured a gateway's log files and LiteLLM's database) with what every
source is asked alike: the monitor's own tenants' key digests, the target's calibration (the
serving monitor has both at hand; the CLI asks the target) and the callers to leave out. Each
source is asked in the list's order; nothing here knows which sources there are.
"""

from __future__ import annotations

import csv
import io
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvcanary.monitor.blast.criterion import criterion_of
from kvcanary.monitor.blast.logs import GatewayLogs, LogSource
from kvcanary.monitor.blast.question import Scope
from kvcanary.monitor.blast.recorded import RecordedTraffic
from kvcanary.monitor.blast.report import BlastRadius
from kvcanary.monitor.blast.source import BlastSource
from kvcanary.monitor.blast.spendlogs import SpendLogs
from kvcanary.monitor.blast.window import deployment_at, window_of
from kvcanary.monitor.config.secrets import litellm_db_url
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.routing import api_base_key, routes_of
from kvcanary.monitor.storage.models import Incident, IncidentEvent, Target

#: Request ids a CSV lists at most (a notification list, not an export of the log).
CSV_LIMIT = 1_000_000


def _recorded_only() -> tuple[BlastSource, ...]:
    """The list of a ``BlastSources`` made without one: the monitor's own traffic, which every
    monitor holds (a benchmark's or a test's; the service builds its list in ``configured_sources``)."""
    return (RecordedTraffic(),)


@dataclass(frozen=True)
class BlastSources:
    #: The sources, each asked in turn; the report lists them in this order.
    sources: tuple[BlastSource, ...] = field(default_factory=_recorded_only)
    exclude: tuple[str, ...] = ()
    own_keys: frozenset[str] = field(default_factory=frozenset)
    #: The target's calibration by name (None: unknown, and prompts are sized by reported counts).
    chars_per_token: Callable[[str], float | None] = field(default=lambda _target: None)


def configured_sources(
    settings: Settings,
    *,
    own_keys: frozenset[str],
    chars_per_token: Callable[[str], float | None],
    logs: Sequence[LogSource] = (),
    litellm_db: str | None = None,
    exclude: Sequence[str] = (),
    threads: int = 1,
) -> BlastSources:
    """The sources the configuration names (``blast_radius``), with what a caller adds: more log
    globs (read as one source with the configured ones), another LiteLLM database (in place of the
    configured one), more callers to leave out (the API adds only callers). ``threads``: what
    DuckDB may use for one scan of the logs."""
    blast = settings.blast_radius
    sources: list[BlastSource] = [RecordedTraffic()]
    globs = [(log.path, log.format) for log in blast.logs] + list(logs)
    if globs:
        sources.append(GatewayLogs(globs, threads))
    url = litellm_db or litellm_db_url(settings)
    if url:
        sources.append(SpendLogs(url))
    return BlastSources(
        sources=tuple(sources),
        exclude=tuple(dict.fromkeys([*blast.exclude_callers, *exclude])),
        own_keys=own_keys,
        chars_per_token=chars_per_token,
    )


def api_bases(settings: Settings, target: str, node: str, base_url: str) -> tuple[str, ...]:
    """The API bases whose requests reach ``node`` of ``target`` (all of its nodes for "")."""
    found = {
        base for base, (name, routed_node) in routes_of(settings).items()
        if name == target and (not node or routed_node in ("", node))
    }  # fmt: skip
    return tuple(sorted(found or {api_base_key(base_url)}))


def scope_of(
    session: Session, incident: Incident, settings: Settings, sources: BlastSources, now: datetime
) -> Scope:
    target = session.execute(
        select(Target.name, Target.base_url).where(Target.id == incident.target_id)
    ).one()
    return Scope(
        target=target.name,
        target_id=incident.target_id,
        node=incident.node,
        window=window_of(session, incident, now),
        criterion=criterion_of(session, incident),
        api_bases=api_bases(settings, target.name, incident.node, target.base_url),
        chars_per_token=sources.chars_per_token(target.name),
        own_keys=sources.own_keys,
        exclude=sources.exclude,
    )


def blast_radius(
    session: Session, incident_id: int, settings: Settings, sources: BlastSources, now: datetime | None = None
) -> BlastRadius | None:
    """Return the blast radius of incident ``incident_id``, or None when there is no such incident."""
    incident = session.get(Incident, incident_id)
    if incident is None:
        return None
    scope = scope_of(session, incident, settings, sources, now or datetime.now(UTC))
    tallies = [source.tally(session, scope) for source in sources.sources]
    facts = _incident_facts(session, incident, scope.target)
    deployment = deployment_at(session, incident, incident.opened_at)
    return BlastRadius(facts, scope, tallies, deployment)


def _incident_facts(session: Session, incident: Incident, target: str) -> dict[str, Any]:
    paged = session.execute(
        select(IncidentEvent.processed_at).where(
            IncidentEvent.incident_id == incident.id,
            IncidentEvent.kind == "opened",
            IncidentEvent.last_error.is_(None),
        )
    ).scalar_one_or_none()
    return {
        "id": incident.id, "target": target, "node": incident.node, "probe": incident.probe,
        "severity": incident.severity, "state": incident.state, "title": incident.title,
        "opened_at": incident.opened_at, "resolved_at": incident.resolved_at, "paged_at": paged,
    }  # fmt: skip


def request_rows(session: Session, radius: BlastRadius) -> list[tuple[str, str, float]]:
    """Return ``(request id, caller, epoch)`` of every response the primary source counts, customers
    only (exclusions out), oldest first: the notification list, from the source that counted it."""
    primary = radius.primary
    if primary is None or primary.source is None:
        return []
    rows = primary.source.requests(session, radius.scope, CSV_LIMIT)
    return [(rid, caller, t) for rid, caller, own, t in rows if not own and caller not in radius.exclude]


#: What begins a formula in a spreadsheet (OWASP, "CSV Injection"); OWASP's other two, tab and
#: carriage return, are control characters and are stripped before a cell is checked.
FORMULA_STARTS = ("=", "+", "-", "@")
#: Unicode categories stripped from a cell: controls (C0, DEL, C1), format characters (bidi
#: overrides, zero-width) and the line and paragraph separators.
_STRIPPED = frozenset({"Cc", "Cf", "Zl", "Zp"})


def csv_cell(value: object) -> str:
    """Return ``value`` as a cell a spreadsheet shows as the text it is: without control or format
    characters, and with a leading ``'`` where it would begin a formula, spaces before it or not
    (a caller or request id is the customer's own text). An operator matching an id strips the quote."""
    text = str(value)
    if not text.isprintable():  # the rare case: only then is each character looked at
        text = "".join(c for c in text if unicodedata.category(c) not in _STRIPPED)
    return "'" + text if text.lstrip(" ").startswith(FORMULA_STARTS) else text


def as_csv(rows: list[tuple[str, str, float]], radius: BlastRadius) -> str:
    """Return the notification list as CSV: one response a line (two responses a gateway gave one
    id are two lines, their ``started_at`` apart), each cell through ``csv_cell``. ``request_id``
    is the id the customer got with the response (``recorded.RecordedTraffic.requests``)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["request_id", "caller", "started_at", "target", "node", "incident"])
    incident = radius.incident
    for rid, caller, t in rows:
        when = datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")
        row = (rid, caller, when, incident["target"], incident["node"], incident["id"])
        writer.writerow([csv_cell(cell) for cell in row])
    return out.getvalue()
