"""The admission guard's facts: what a gateway needs to refuse, before any upstream call, a prompt
a deployment's KV pool surely cannot hold (issue 36; the admission check the incident's engine
lacked, enforced from what kvcanary measured).

For each target whose containment policy sets ``admission_guard`` to ``observe`` or ``enforce``
(``config/targets.py``), the monitor publishes beside the quarantine set (``GET /api/v1/quarantine``,
its ``guards``; ``docs/tap-protocol.md``):

- ``kv_pool_tokens``: the smallest KV pool of the nodes that admit the target's requests (its
  prefill and aggregated nodes; a target without named nodes, its own reading). A request may land
  on any of them, so the smallest is the one that must hold it. While one of them has no reading,
  the target has no guard: a bound that leaves a node out is no bound;
- ``chars_per_token``: the most characters a token of the target's tokenizer held in the monitor's
  own probes (``targets/calibration.py``), None until it was measured.

What a gateway does with them is the tap's (``kvcanary/tap/containment/guard.py``): only a sure count
refuses. Both come from the traffic judge's facts (``traffic/facts.py``), so each node's pool is read
and kept once for the judge and the guard alike, and read again when its configuration changes. The
facts are gathered in the background every ``REFRESH_SECONDS`` (a housekeeping job): the gateways'
poll reads memory only and never waits for a node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.traffic.facts import TargetFacts

log = logging.getLogger("kvcanary.containment")

#: How often the guarded targets' facts are gathered again (a pool changes only with a restart of
#: its node, which the capacity audit reports, and the judge's facts then read it again).
REFRESH_SECONDS = 15.0


@dataclass(frozen=True)
class GuardFacts:
    """One guarded target's facts, as the gateways get them."""

    target: str
    mode: str  # observe | enforce
    kv_pool_tokens: int
    chars_per_token: float | None


class AdmissionFacts:
    """The guarded targets' facts; ``settings`` returns the settings in force, ``clients`` are the
    targets' clients by name (the monitor's own, kept up to date by reloads) and ``facts`` the
    traffic judge's, which read and keep their pools and calibration."""

    def __init__(self, settings: Callable[[], Settings], clients: Mapping[str, Any], facts: TargetFacts):
        self.settings = settings
        self.clients = clients
        self.facts = facts
        self._facts: dict[str, GuardFacts] = {}
        #: Whether the pools were read once: before, no guard is known, which is not "none".
        self.refreshed = False

    def current(self) -> list[GuardFacts]:
        """Return the facts of every guarded target with a known pool, by name."""
        return [self._facts[name] for name in sorted(self._facts)]

    async def refresh(self) -> None:
        """Read every guarded target's pools again (all at once); a target whose reading failed
        keeps no guard until one succeeds."""
        settings = self.settings()
        guarded = [(t, settings.containment_of(t).admission_guard) for t in settings.targets]
        guarded = [(t, mode) for t, mode in guarded if mode != "off" and t.name in self.clients]
        found = await asyncio.gather(*(self._read(t, mode) for t, mode in guarded))
        self._facts = {facts.target: facts for facts in found if facts is not None}
        self.refreshed = True

    async def _read(self, target: TargetConfig, mode: str) -> GuardFacts | None:
        try:
            pool = await self.admitting_pool(target.name)
            chars_per_token = await self.facts.chars_per_token(target.name)
        except Exception as exc:  # a node that does not answer: no guard, said once a refresh
            log.info("admission guard of %s: no pool reading (%s)", target.name, type(exc).__name__)
            return None
        return None if pool is None else GuardFacts(target.name, mode, pool, chars_per_token)

    async def admitting_pool(self, target: str) -> int | None:
        """Return the smallest KV pool of the nodes that admit ``target``'s requests (module doc),
        or None where one of them has none known."""
        nodes = getattr(self.clients[target], "nodes", [])
        admitting = [n.name for n in nodes if n.name and n.role != "decode"]
        if not admitting:  # the target's own reading
            return await self.facts.pool(target, "")
        pools = await asyncio.gather(*(self.facts.pool(target, name) for name in admitting))
        known = [pool for pool in pools if pool is not None]
        return min(known) if len(known) == len(pools) else None
