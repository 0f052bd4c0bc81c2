"""The admission guard's facts: what a gateway needs to refuse, before any upstream call, a prompt
a deployment's KV pool surely cannot hold (the admission check the incident's engine lacked,
enforced from what kvcanary measured).

For each target whose containment policy sets ``admission_guard`` to ``observe`` or ``enforce``
(``config/containment_policy.py``), the monitor publishes beside the quarantine set
(``GET /api/v1/quarantine``, its ``guards``; ``docs/tap-protocol.md``) one guard per deployment,
each naming its api_base keys (``monitor/routing.py``'s ``routes_of``: the target's ``base_url``
and ``gateway_api_bases``, and each node's URL):

- ``kv_pool_tokens``: for a node's own deployment (its api_base is a prefill or aggregated node's
  URL), that node's smallest KV pool; for the target's (its ``base_url``, a gateway routing to any of
  its nodes, and a decode node's URL, which admits nothing itself), the smallest pool of the nodes
  that admit its requests (prefill and aggregated; a target without named nodes, its own reading).
  A request may land on any of them, so the smallest is the one that must hold it. While one of
  them has no reading, the target's deployment has no guard: a bound that leaves a node out
  unread is no bound. A reading the monitor does not trust (``traffic/facts.py``: a pool below any
  real engine's, below the node's own input limit, or moved without a configuration change) guards
  nothing: that node's deployment has none, and the target's leaves it out, so one node reporting
  16 tokens cannot make every gateway refuse every prompt over 16. Leaving it out weakens the
  target's bound only towards what no guard at all would do: a prompt over the untrusted node's
  real pool but within the others' is admitted, as it would be with no guard, while a prompt over
  the smallest trusted pool is still refused (a node that surely cannot hold it may get it); the
  untrusted reading itself is reported (``kvcanary_node_pool_untrusted``, ``KVCanaryNodePoolUntrusted``);
- ``chars_per_token``: the most characters a token of the target's tokenizer held in the monitor's
  own probes (``targets/calibration.py``), None until it was measured or where no tokenizer could
  have measured it.

What a gateway does with them is the tap's (``kvcanary/tap/containment/guard.py``): only a sure count
refuses. Both come from the traffic judge's facts (``traffic/facts.py``), so each node's pool is read
and kept once for the judge and the guard alike, and read again when its configuration changes. The
facts are gathered in the background every ``REFRESH_SECONDS`` (a housekeeping job): the gateways'
poll reads memory only and never waits for a node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.routing import routes_of
from kvcanary.monitor.traffic.facts import PoolReading, TargetFacts

log = logging.getLogger("kvcanary.containment")

#: How often the guarded targets' facts are gathered again (a pool changes only with a restart of
#: its node, which the capacity audit reports, and the judge's facts then read it again).
REFRESH_SECONDS = 15.0


@dataclass(frozen=True)
class GuardFacts:
    """One guarded deployment's facts, as the gateways get them: ``api_bases`` are the keys it
    covers (a node's own, or the target's)."""

    target: str
    mode: str  # observe | enforce
    kv_pool_tokens: int
    chars_per_token: float | None
    api_bases: tuple[str, ...] = ()


class AdmissionFacts:
    """The guarded targets' facts; ``settings`` returns the settings in force, ``clients`` are the
    targets' clients by name (the monitor's own, kept up to date by reloads) and ``facts`` the
    traffic judge's, which read and keep their pools and calibration."""

    def __init__(self, settings: Callable[[], Settings], clients: Mapping[str, Any], facts: TargetFacts):
        self.settings = settings
        self.clients = clients
        self.facts = facts
        self._facts: dict[str, list[GuardFacts]] = {}
        #: Whether the pools were read once: before, no guard is known, which is not "none".
        self.refreshed = False
        self._first_read: asyncio.Event | None = None  # made on the loop that waits for it

    def current(self) -> list[GuardFacts]:
        """Return the guard of every guarded deployment with a known, trusted pool, by target and
        then by api_base."""
        return [guard for name in sorted(self._facts) for guard in self._facts[name]]

    async def refresh(self) -> None:
        """Read every guarded target's pools again (all at once); a deployment whose reading
        failed, or is not trusted, keeps no guard until one succeeds."""
        settings = self.settings()
        routes = routes_of(settings)
        guarded = [(t, settings.containment_of(t).admission_guard) for t in settings.targets]
        guarded = [(t, mode) for t, mode in guarded if mode != "off" and t.name in self.clients]
        found = await asyncio.gather(*(self._read(t, mode, routes) for t, mode in guarded))
        self._facts = {target.name: guards for (target, _), guards in zip(guarded, found, strict=True)}
        self.refreshed = True
        if self._first_read is not None:
            self._first_read.set()

    async def read_once(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for the pools' first reading; return whether it was made."""
        if not self.refreshed:
            self._first_read = self._first_read or asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._first_read.wait()
        return self.refreshed

    async def _read(
        self, target: TargetConfig, mode: str, routes: Mapping[str, tuple[str, str]]
    ) -> list[GuardFacts]:
        try:
            pools = await self.pools(target.name)
            chars_per_token = await self.facts.chars_per_token(target.name)
        except Exception as exc:  # a node that does not answer: no guard, said once a refresh
            log.info("admission guard of %s: no pool reading (%s)", target.name, type(exc).__name__)
            return []
        bases: dict[int, list[str]] = {}  # api_base keys by the pool that guards them
        for key, (name, node) in routes.items():
            if name == target.name and (pool := pools.get(node, pools.get(""))) is not None:
                bases.setdefault(pool, []).append(key)
        return [
            GuardFacts(target.name, mode, pool, chars_per_token, tuple(sorted(keys)))
            for pool, keys in sorted(bases.items(), key=lambda item: sorted(item[1]))
        ]

    async def pools(self, target: str) -> dict[str, int | None]:
        """Return the pool guarding each of ``target``'s admitting nodes' deployments, by node name,
        and its own deployment's under ``""`` (module doc); None where there is none."""
        nodes = getattr(self.clients[target], "nodes", [])
        admitting = [n.name for n in nodes if n.name and n.role != "decode"]
        if not admitting:  # the target's own reading
            own = await self.facts.reading(target, "")
            return {"": None if own is None else own.trusted}
        read = await asyncio.gather(*(self.facts.reading(target, name) for name in admitting))
        readings: dict[str, PoolReading | None] = dict(zip(admitting, read, strict=True))
        pools: dict[str, int | None] = {name: r.trusted if r else None for name, r in readings.items()}
        trusted = [pool for pool in pools.values() if pool is not None]
        unread = any(reading is None for reading in readings.values())
        pools[""] = min(trusted) if trusted and not unread else None
        return pools
