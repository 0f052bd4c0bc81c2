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

What a gateway does with them is the tap's (``kvcanary/tap/admission.py``): only a sure count
refuses. The readings are refreshed in the background every ``REFRESH_SECONDS`` (a housekeeping
job): the gateways' poll reads memory only and never waits for a node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.traffic.facts import smallest_pool

log = logging.getLogger("kvcanary.containment")

#: How often the guarded targets' pools are read again (a pool changes only with a restart of its
#: node, which the capacity audit also reports).
REFRESH_SECONDS = 15.0


@dataclass(frozen=True)
class GuardFacts:
    """One guarded target's facts, as the gateways get them."""

    target: str
    mode: str  # observe | enforce
    kv_pool_tokens: int
    chars_per_token: float | None


class AdmissionFacts:
    """The guarded targets' facts, read from their clients; ``settings`` returns the settings in
    force and ``clients`` are the targets' clients by name (the monitor's own, kept up to date by
    reloads)."""

    def __init__(self, settings: Callable[[], Settings], clients: Mapping[str, Any]):
        self.settings = settings
        self.clients = clients
        self._facts: dict[str, GuardFacts] = {}

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

    async def _read(self, target: TargetConfig, mode: str) -> GuardFacts | None:
        client = self.clients[target.name]
        try:
            pool = await admitting_pool(client)
        except Exception as exc:  # a node that does not answer: no guard, said once a refresh
            log.info("admission guard of %s: no pool reading (%s)", target.name, type(exc).__name__)
            return None
        if pool is None:
            return None
        calibration = getattr(client, "calibration", None)
        chars_per_token = getattr(calibration, "chars_per_token", None)
        return GuardFacts(target.name, mode, pool, chars_per_token)


async def admitting_pool(client: Any) -> int | None:
    """Return the smallest KV pool of the nodes that admit ``client``'s requests (module doc), or
    None where one of them has none known."""
    admitting = [n for n in getattr(client, "nodes", []) if n.name and n.role != "decode"]
    if not admitting:
        return smallest_pool(await client.capacity(max_age=REFRESH_SECONDS))
    pools = await asyncio.gather(*(client.node_capacity(n) for n in admitting))
    sizes = [smallest_pool(reading) for reading in pools]
    return None if None in sizes else min(s for s in sizes if s is not None)
