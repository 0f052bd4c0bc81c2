"""When an incident's fault could have reached customers: from the earliest evidence of its
condition to its resolution (or now), each bound with how it was found.

- A pool below the window (``capacity``, ``boundary``, ``traffic_capacity``): the first capacity
  reading of the node below the window since its last reading that was not (that reading is also
  where a configuration change shows). With no fine reading before it, the pool may have been
  below the window before the monitor first read it: since the monitor first saw the target.
- Otherwise, or where no such reading is kept: the last pass of the incident's own probe before
  the failure that opened it (``incident.last_pass_at``, kept with the incident because passes are
  pruned after a week); with no pass before, since the monitor first saw the target.
- The end: the resolution (after the passes the incident rules ask for), else now.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvcanary.monitor.blast.question import Bound, Window
from kvcanary.monitor.storage.models import Incident, ProbeResultRow, Target
from kvcanary.monitor.traffic.checks import REGISTRY as TRAFFIC_CHECKS
from kvcanary.probes import REGISTRY

#: Incident kinds whose condition is the node's pool against its window: the probe kinds and the
#: traffic checks that say so (``traffic_capacity``).
POOL_KINDS = frozenset(
    {
        *(kind for kind, probe in REGISTRY.items() if probe.judges_pool),
        *(check.result_kind for check in TRAFFIC_CHECKS if check.judges_pool),
    }
)


def window_of(session: Session, incident: Incident, now: datetime) -> Window:
    start = _pool_start(session, incident) if incident.probe in POOL_KINDS else None
    if start is None:
        start = _last_pass_start(session, incident)
    if incident.resolved_at is not None:
        end = Bound(incident.resolved_at, "resolved: the incident's probe passed again as the rules ask")
    else:
        end = Bound(now, "still open: until now")
    return Window(start, end)


def _node_filter(incident: Incident) -> list[Any]:
    return [ProbeResultRow.node == incident.node] if incident.node else []


def _pool_start(session: Session, incident: Incident) -> Bound | None:
    """The first capacity reading below the window since the node's last reading that was not."""
    readings = [
        ProbeResultRow.target_id == incident.target_id,
        ProbeResultRow.probe == "capacity",
        ProbeResultRow.started_at <= incident.opened_at,
        *_node_filter(incident),
    ]
    last_fine = session.execute(
        select(ProbeResultRow.started_at)
        .where(*readings, ProbeResultRow.verdict == "pass")
        .order_by(ProbeResultRow.started_at.desc())
        .limit(1)
    ).scalar_one_or_none()
    below = [*readings, ProbeResultRow.reason == "pool_below_context_window"]
    if last_fine is not None:
        below.append(ProbeResultRow.started_at > last_fine)
    first = session.execute(
        select(ProbeResultRow.id, ProbeResultRow.started_at, ProbeResultRow.node, ProbeResultRow.evidence)
        .where(*below)
        .order_by(ProbeResultRow.started_at, ProbeResultRow.id)
        .limit(1)
    ).one_or_none()
    if first is None:
        return None
    node = first.node or "the node"
    if last_fine is None:  # nothing says when the pool went below: as far back as the monitor saw
        first_seen = _first_seen(session, incident)
        how = f"no capacity reading of {node} was fine before its first below the context window "
        how += f"(result {first.id}): since the monitor first saw the target"
        return Bound(min(first_seen, first.started_at), how)
    changed = "config_change" in (first.evidence or {})
    how = f"the first capacity reading of {node} with its pool below the context window"
    how += f" (result {first.id}" + ("; it saw the configuration change" if changed else "")
    how += f"; the reading before, at {last_fine:%Y-%m-%d %H:%M:%S} UTC, was fine"  # the fault began between
    return Bound(first.started_at, how + ")")


def _first_seen(session: Session, incident: Incident) -> datetime:
    when: datetime = session.execute(
        select(Target.created_at).where(Target.id == incident.target_id)
    ).scalar_one()
    return when


def _last_pass_start(session: Session, incident: Incident) -> Bound:
    if incident.last_pass_at is not None:
        return Bound(incident.last_pass_at, f"the last pass of {incident.probe} before its first failure")
    how = f"no pass of {incident.probe} before its first failure is known"
    how += ": since the monitor first saw the target"
    return Bound(_first_seen(session, incident), how)


def deployment_at(session: Session, incident: Incident, moment: datetime) -> dict[str, Any]:
    """Return the node's configuration and engine version as its last capacity reading before
    ``moment`` stated them (empty when no reading is kept)."""
    evidence = session.execute(
        select(ProbeResultRow.evidence)
        .where(
            ProbeResultRow.target_id == incident.target_id,
            ProbeResultRow.probe == "capacity",
            ProbeResultRow.started_at <= moment,
            *_node_filter(incident),
        )
        .order_by(ProbeResultRow.started_at.desc())
        .limit(1)
    ).scalar_one_or_none()
    keys = ("node", "version", "context_window", "pools", "disaggregation_mode", "max_req_input_len")
    return {k: evidence[k] for k in keys if evidence and evidence.get(k) is not None}
