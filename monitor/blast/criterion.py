"""Which responses an incident exposed, by what the incident is.

- A pool below the context window, or a node that answered a prompt over its pool
  (``capacity``, ``boundary``, ``traffic_capacity``): requests to that node over the pool that were
  answered 2xx. The pool is the one the incident's own evidence states, else the node's latest
  capacity reading.
- A traffic check's finding (``traffic_marker``, ``traffic_overlap``, ``traffic_tokens``): the
  records that check flagged.
- Any other leak or mismatch (a probe saw another tenant's text, a counter moved, a known
  defective version): every request to the node, counted as at risk, not as affected.
- A warning (the probe could not judge): an availability incident that exposed nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvcanary.monitor.blast.question import Criterion
from kvcanary.monitor.blast.window import POOL_KINDS
from kvcanary.monitor.storage.models import Incident, ProbeResultRow
from kvcanary.monitor.traffic.checks import REGISTRY as TRAFFIC_CHECKS

#: The traffic checks' result kinds whose findings are the records themselves, to their names (a
#: check that judges the pool is a pool problem: over the pool, whatever was flagged).
FLAGGED_KINDS = {check.result_kind: check.name for check in TRAFFIC_CHECKS if not check.judges_pool}


def criterion_of(session: Session, incident: Incident) -> Criterion:
    if incident.severity == "warning":
        return Criterion(
            "none", "an availability incident (the probe could not judge): no response was exposed by it"
        )
    if incident.probe in FLAGGED_KINDS:
        check = FLAGGED_KINDS[incident.probe]
        return Criterion("flagged", f"the gateway records the {check} check flagged", check=check)
    if incident.probe in POOL_KINDS:
        pool = _pool(session, incident)
        if pool is not None:
            text = f"requests over the node's {pool:,}-token KV pool answered 2xx"
            return Criterion("over_pool", text, pool_tokens=pool)
    return Criterion(
        "at_risk", "every request to the node answered 2xx: no narrower rule is known for this kind"
    )


def smallest_pool(evidence: dict[str, Any]) -> int | None:
    """Return the smallest pool an evidence document states (a capacity reading, a boundary run,
    a traffic result's records), or None."""
    sizes: list[int] = []
    for holder in (evidence, evidence.get("capacity") or {}):
        pools = holder.get("pools")
        if isinstance(pools, dict):
            sizes += [v for v in pools.values() if isinstance(v, int) and v > 0]
        if isinstance(holder.get("kv_pool_tokens"), int) and holder["kv_pool_tokens"] > 0:
            sizes.append(holder["kv_pool_tokens"])
    for record in evidence.get("records") or []:
        if isinstance(record, dict) and isinstance(record.get("kv_pool_tokens"), int):
            sizes.append(record["kv_pool_tokens"])
    return min(sizes) if sizes else None


def _pool(session: Session, incident: Incident) -> int | None:
    linked = session.execute(
        select(ProbeResultRow.evidence)
        .where(ProbeResultRow.incident_id == incident.id, ProbeResultRow.verdict != "pass")
        .order_by(ProbeResultRow.started_at.desc())
        .limit(20)
    ).scalars()
    for evidence in linked:
        if (pool := smallest_pool(evidence or {})) is not None:
            return pool
    node = [ProbeResultRow.node == incident.node] if incident.node else []
    reading = session.execute(
        select(ProbeResultRow.evidence)
        .where(
            ProbeResultRow.target_id == incident.target_id,
            ProbeResultRow.probe == "capacity",
            ProbeResultRow.started_at <= incident.opened_at,  # the pool then, not the fixed one
            *node,
        )
        .order_by(ProbeResultRow.started_at.desc())
        .limit(1)
    ).scalar_one_or_none()
    return smallest_pool(reading or {})
