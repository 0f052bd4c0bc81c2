"""Compute an incident's blast radius: the question from its rows, then every source's answer.

``BlastSources`` names what to read besides the monitor's own traffic: log file globs (each with
its format) and LiteLLM's database. The caller passes the monitor's own tenants' key digests and
the target's calibration (the serving monitor has both at hand; the CLI asks the target).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from monitor.blast.criterion import criterion_of
from monitor.blast.logs import logs_requests, logs_tally
from monitor.blast.question import Scope
from monitor.blast.recorded import recorded_requests, recorded_tally
from monitor.blast.report import BlastRadius
from monitor.blast.spendlogs import spendlogs_requests, spendlogs_tally
from monitor.blast.window import deployment_at, window_of
from monitor.config.secrets import litellm_db_url
from monitor.config.settings import Settings
from monitor.storage.models import Incident, IncidentEvent, Target
from monitor.traffic.judge import api_base_key, routes_of

#: Request ids a CSV lists at most (a notification list, not an export of the log).
CSV_LIMIT = 1_000_000


@dataclass(frozen=True)
class BlastSources:
    logs: tuple[tuple[str, str], ...] = ()  # (glob, format: auto | litellm | sglang | openai)
    litellm_db: str | None = None
    exclude: tuple[str, ...] = ()
    own_keys: frozenset[str] = field(default_factory=frozenset)
    #: The target's calibration by name (None: unknown, and prompts are sized by reported counts).
    chars_per_token: Callable[[str], float | None] = field(default=lambda _target: None)
    threads: int = 1


def configured_sources(
    settings: Settings,
    *,
    own_keys: frozenset[str],
    chars_per_token: Callable[[str], float | None],
    logs: Sequence[tuple[str, str]] = (),
    litellm_db: str | None = None,
    exclude: Sequence[str] = (),
    threads: int = 1,
) -> BlastSources:
    """The sources the configuration names (``blast_radius``), with what a caller adds: more log
    globs, another LiteLLM database, more callers to leave out (the API adds only callers)."""
    blast = settings.blast_radius
    return BlastSources(
        logs=tuple((log.path, log.format) for log in blast.logs) + tuple(logs),
        litellm_db=litellm_db or litellm_db_url(settings),
        exclude=tuple(dict.fromkeys([*blast.exclude_callers, *exclude])),
        own_keys=own_keys,
        chars_per_token=chars_per_token,
        threads=threads,
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
    tallies = [recorded_tally(session, scope)]
    if sources.logs:
        tallies.append(logs_tally(list(sources.logs), scope, sources.threads))
    if sources.litellm_db:
        tallies.append(spendlogs_tally(sources.litellm_db, scope))
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


def request_rows(
    session: Session, radius: BlastRadius, sources: BlastSources
) -> list[tuple[str, str, float]]:
    """Return ``(request id, caller, epoch)`` of every response the primary source counts, customers
    only (exclusions out), oldest first: the notification list."""
    primary, scope = radius.primary, radius.scope
    if primary is None:
        return []
    rows: list[tuple[str, str, bool, float]]
    if primary.name == "gateway logs":
        rows = logs_requests(list(sources.logs), scope, CSV_LIMIT, sources.threads)
    elif primary.name == "LiteLLM_SpendLogs" and sources.litellm_db:
        rows = spendlogs_requests(sources.litellm_db, scope, CSV_LIMIT)
    else:
        rows = recorded_requests(session, scope, CSV_LIMIT)
    return [(rid, caller, t) for rid, caller, own, t in rows if not own and caller not in radius.exclude]


def as_csv(rows: list[tuple[str, str, float]], radius: BlastRadius) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["request_id", "caller", "started_at", "target", "node", "incident"])
    incident = radius.incident
    for rid, caller, t in rows:
        when = datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")
        writer.writerow([rid, caller, when, incident["target"], incident["node"], incident["id"]])
    return out.getvalue()
