"""Following the nodes SGLang's model gateway lists, so a target audits every node it routes to.

A target that names its gateway (``sglang_router``) has its ``GET /workers`` read every
``discovery_interval_seconds``. What the gateway lists is merged into the target's nodes after the
ones the file lists (a listed name wins: an operator's word on a node outranks the gateway's), and
the settings so made are taken up exactly as a reload takes up a changed file: the target's client
is replaced, its runs keep going, and node-scoped kinds run at once on a node that joined
(``monitor/app.py``). A node that left is logged, with the gateway that dropped it.

A gateway that cannot be read is a logged error and its last known nodes stay: a gateway restart or
a network blip must not make every node vanish from the audits (and come back as "joined"). A
gateway that answers with an empty list is believed: it routes to nobody.

A node the gateway lists is asked once, when it joins and without a credential, whether it takes
requests without one (``refuses_without_key``): outside the target's credential scope it is sent
no credential, so a node that refuses cannot be probed, and its pairs are counted as such.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import NodeConfig, TargetConfig
from kvcanary.monitor.targets.http import HttpClient
from kvcanary.monitor.targets.sglang_gateway import (
    GatewayUnreadable,
    read_circuits,
    read_dp_size,
    read_workers,
    refuses_without_key,
)
from kvcanary.monitor.targets.wire import Limits

log = logging.getLogger("kvcanary.discovery")

#: How often the discovery job looks for a gateway that is due; each target's own interval decides.
DISCOVERY_TICK_SECONDS = 1.0


@dataclass
class NodeChange:
    """The nodes that joined and left one target's gateway at one reading, by name."""

    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


class GatewayDiscovery:
    """Each gateway target's nodes as last read, and the file's settings they are merged into."""

    def __init__(self, configured: Settings, http: HttpClient, limits: Limits):
        #: The settings as the file states them (replaced at each reload by :meth:`take_up`).
        self.configured = configured
        self._http = http
        self._limits = limits
        #: The nodes each target's gateway listed at its last successful reading.
        self.found: dict[str, list[NodeConfig]] = {}
        #: What each target's gateway said of its nodes' health at that reading, by node name.
        self.health: dict[str, dict[str, bool]] = {}
        #: Its circuit breaker of each node at that reading (0 closed, 1 open, 2 half-open), where
        #: the target names the gateway's metrics page and it could be read.
        self.circuits: dict[str, dict[str, int]] = {}
        self._read_at: dict[str, float] = {}  # time.monotonic() of each target's last reading

    def take_up(self, configured: Settings) -> Settings:
        """Take ``configured`` (a reloaded file) as the file's settings; return it with the nodes
        found so far merged in. A target that no longer names the same gateway forgets what it
        found there, and its new gateway is read at the next tick."""
        before = {t.name: t.sglang_router for t in self.configured.targets}
        self.configured = configured
        gateways = {t.name: t.sglang_router for t in configured.targets if t.sglang_router}
        for name in list(self.found):
            if gateways.get(name) != before.get(name):
                del self.found[name]
                self.health.pop(name, None)
                self.circuits.pop(name, None)
                self._read_at.pop(name, None)
        return self.merged()

    def merged(self) -> Settings:
        """Return the file's settings with each target's found nodes after its listed ones."""
        targets = [self._with_found(target) for target in self.configured.targets]
        merged = self.configured.model_copy(update={"targets": targets})
        merged.model_post_init(None)  # a copy keeps the original's lookup by name: make it anew
        return merged

    def _with_found(self, target: TargetConfig) -> TargetConfig:
        found = self.found.get(target.name)
        if not found:
            return target
        listed = {node.name for node in target.nodes}
        nodes = [*target.nodes, *(node for node in found if node.name not in listed)]
        return target.model_copy(update={"nodes": nodes})

    async def refresh(self) -> dict[str, NodeChange]:
        """Read every gateway that is due, at once; return each target whose nodes changed."""
        now = time.monotonic()
        due = [
            target
            for target in self.configured.targets
            if target.sglang_router is not None
            and now - self._read_at.get(target.name, -target.discovery_interval_seconds)
            >= target.discovery_interval_seconds
        ]
        for target in due:
            self._read_at[target.name] = now
        changes = await asyncio.gather(*(self._read(target) for target in due))
        return {target.name: change for target, change in zip(due, changes, strict=True) if change}

    async def _read(self, target: TargetConfig) -> NodeChange | None:
        """Read one gateway; return what changed, or None (unchanged, or unreadable: logged)."""
        gateway = target.sglang_router
        assert gateway is not None  # refresh() reads only targets that name a gateway
        try:
            listed = await read_workers(self._http, gateway, target.timeout_seconds, self._limits)
        except GatewayUnreadable as exc:
            kept = len(self.found.get(target.name, []))
            log.error("%s: gateway unreadable, keeping its %d last known node(s): %s", target.name, kept, exc)
            return None
        if listed.skipped:
            log.warning("%s: gateway %s listed %d worker(s) that are not nodes (no readable type or URL)",
                        target.name, gateway, listed.skipped)  # fmt: skip
        self.health[target.name] = listed.healthy
        await self._read_circuits(target, listed.nodes)
        before = {node.name: node for node in self.found.get(target.name, [])}
        after = await self._with_ranks(target, before, listed.nodes)
        after = await self._with_refusals(target, before, after)
        if before == after and target.name in self.found:
            return None
        self.found[target.name] = list(after.values())
        change = NodeChange(
            joined=[name for name, node in after.items() if before.get(name) != node],
            left=[name for name in before if name not in after],
        )
        for name in change.joined:
            log.info("node %s joined gateway %s (target %s)", name, gateway, target.name)
        for name in change.left:
            log.warning("node %s left gateway %s (target %s)", name, gateway, target.name)
        return change if change.joined or change.left else None

    async def _read_circuits(self, target: TargetConfig, nodes: list[NodeConfig]) -> None:
        """Read the gateway's circuit breakers, where the target names its metrics page; an
        unreadable page leaves none (a stale state would say a breaker is closed that may not be)."""
        if target.sglang_router_metrics is None:
            self.circuits.pop(target.name, None)
            return
        try:
            self.circuits[target.name] = await read_circuits(
                self._http, target.sglang_router_metrics, nodes, target.timeout_seconds, self._limits
            )
        except GatewayUnreadable as exc:
            if self.circuits.pop(target.name, None) is not None or target.name not in self.found:
                log.warning("%s: the gateway's metrics page is unreadable: %s", target.name, exc)

    async def _with_refusals(
        self, target: TargetConfig, before: dict[str, NodeConfig], after: dict[str, NodeConfig]
    ) -> dict[str, NodeConfig]:
        """Return ``after`` with whether each prefill and decode node refuses a request without a
        credential: as a node seen before did, else asked of a new one (once, when it joins). A node
        outside the target's credential scope that refuses is logged: its pairs are not probed."""
        new = [
            node for name, node in after.items() if name not in before and node.role in ("prefill", "decode")
        ]
        answers = await asyncio.gather(
            *(refuses_without_key(self._http, node, target.timeout_seconds, self._limits) for node in new)
        )
        out = {
            name: node.model_copy(update={"refuses_without_key": before[name].refuses_without_key})
            if name in before
            else node
            for name, node in after.items()
        }
        scope = target.credential_scope()
        for node, refuses in zip(new, answers, strict=True):
            out[node.name] = node.model_copy(update={"refuses_without_key": refuses})
            if refuses and not scope.allows(node.info_url or ""):
                log.warning("%s: node %s, listed by gateway %s outside the credential scope, refuses "
                            "requests without a key: its pairs are not probed (credential_hosts names the "
                            "hosts that may have one)",
                            target.name, node.name, target.sglang_router)  # fmt: skip
        return out

    async def _with_ranks(
        self, target: TargetConfig, before: dict[str, NodeConfig], listed: list[NodeConfig]
    ) -> dict[str, NodeConfig]:
        """Return the listed nodes by name, each with its data-parallel ranks: as the gateway lists
        them (``URL@rank``), else as a node seen before had them, else read from a new node's
        server info (once, when it joins: a restart with other ranks is a new listing only if the
        gateway lists it anew)."""
        after: dict[str, NodeConfig] = {}
        unknown: list[NodeConfig] = []
        for node in listed:
            if node.dp_size == 1 and (known := before.get(node.name)) is not None:
                node = node.model_copy(update={"dp_size": known.dp_size})
            elif node.dp_size == 1 and node.role in ("prefill", "decode"):
                unknown.append(node)
            after[node.name] = node
        sizes = await asyncio.gather(
            *(read_dp_size(self._http, node, target.timeout_seconds, self._limits) for node in unknown)
        )
        for node, size in zip(unknown, sizes, strict=True):
            after[node.name] = node.model_copy(update={"dp_size": size})
        return after
