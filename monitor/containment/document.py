"""The quarantine set as the gateways read it (``docs/tap-protocol.md``, "Quarantine"): one document,
signed (``containment/signing.py``) and served at ``GET /api/v1/quarantine`` (``api/containment.py``)
and, where the traffic stream is used, put in the JetStream KV bucket the taps watch
(``containment/bucket.py``).

Each entry names the api_base keys (``kvcanary.wire.api_base_key``) routed to its target, so a tap
compares its deployments' own with no knowledge of the monitor's targets."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.containment.guards import GuardFacts
from kvcanary.monitor.containment.rules import Quarantine
from kvcanary.monitor.routing import routes_of

#: The document's shape; a tap refuses a version it does not know and keeps its last set.
SET_VERSION = 2


def quarantine_set(
    quarantines: Iterable[Quarantine], guards: Iterable[GuardFacts], settings: Settings, now: datetime,
    revision: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Return the set as JSON-ready data: every quarantined target (``enforced: false``: the
    observe policy's, counted and not filtered), the guarded targets' admission facts, the
    ``revision`` it was read at (the newest quarantine change's: it only grows), when it was
    generated (``now``) and when it expires (``containment_signing.expires_seconds`` later)."""
    bases = api_bases(settings)
    expires = now + timedelta(seconds=settings.containment_signing.expires_seconds)
    return {
        "version": SET_VERSION,
        "revision": revision,
        "generated_at": now.isoformat(),
        "expires_at": expires.isoformat(),
        "deployments": [
            {
                "target": q.target, "api_bases": bases.get(q.target, []), "enforced": q.enforced,
                "cause": q.cause, "incident_id": q.incident_id, "reason": q.reason,
                "since": q.since.isoformat(),
            }
            for q in quarantines
        ],
        "guards": [
            {
                "target": g.target, "api_bases": list(g.api_bases), "mode": g.mode,
                "kv_pool_tokens": g.kv_pool_tokens, "chars_per_token": g.chars_per_token,
            }
            for g in guards
        ],
    }  # fmt: skip


def api_bases(settings: Settings) -> dict[str, list[str]]:
    """Return each target's api_base keys, sorted: what a tap compares its deployments' with."""
    bases: dict[str, list[str]] = {}
    for key, (target, _) in routes_of(settings).items():
        bases.setdefault(target, []).append(key)
    return {target: sorted(keys) for target, keys in bases.items()}
