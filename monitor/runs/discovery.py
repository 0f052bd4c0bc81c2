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

No gateway and no node can hold up or break another's discovery:

- each gateway is read by a reading of its own (a task), at most one at a time; :meth:`refresh`
  starts those that are due, waits for them at most ``ROUND_WAIT_SECONDS`` and takes up those that
  finished, the rest at a later call: the discovery tick never waits out one slow gateway;
- each read is time-boxed on its own (the worker list, the metrics page, each node's server info
  and join-time question: ``READ_SECONDS``, or the target's ``timeout_seconds`` if shorter); the
  metrics page is read beside the listing, never before a node may join; a node whose join-time
  reads are still under way after ``JOIN_WAIT_SECONDS`` joins at a later reading, so a slow node
  holds back no other;
- every exception a read raises is caught where it was raised, counted per target, node and read
  (:class:`ReadTrouble`, ``kvcanary_gateway_read_errors_total``) and logged once an episode; a
  node whose join-time read failed joins with what is known (one rank, no refusal);
- what the gateway lists is bounded (``targets/sglang_gateway.py``: at most 1,000 workers, URLs
  no engine can have refused, names made plain) and takes nothing the file gives another target
  (``claimed``); refused workers are counted by why (``kvcanary_gateway_workers_refused``) and
  logged once each time that count changes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import NodeConfig, TargetConfig
from kvcanary.monitor.routing import api_base_key, routes_of
from kvcanary.monitor.runs.read_trouble import ReadTrouble
from kvcanary.monitor.targets.http import HttpClient
from kvcanary.monitor.targets.openai_format import Limits
from kvcanary.monitor.targets.sglang_gateway import (
    GatewayUnreadable,
    NodeUnreadable,
    WorkerList,
    read_circuits,
    read_dp_size,
    read_workers,
    refuses_without_key,
)

log = logging.getLogger("kvcanary.discovery")

#: How often the discovery job looks for a gateway that is due; each target's own interval decides.
DISCOVERY_TICK_SECONDS = 1.0
#: The most one read may take (the worker list, the metrics page, one node's server info or its
#: join-time question), or the target's ``timeout_seconds`` where that is shorter: a gateway answers
#: its list in milliseconds, and a read that outlasts a few discovery intervals is trouble to count,
#: not to wait for.
READ_SECONDS = 5.0
#: How long :meth:`GatewayDiscovery.refresh` waits for the readings under way before it returns
#: what finished: under the discovery tick, so the tick is never skipped for one slow gateway.
ROUND_WAIT_SECONDS = 0.5
#: How long a reading waits for its new nodes' join-time reads before it is taken up without the
#: nodes still being read (they join at a later reading).
JOIN_WAIT_SECONDS = 1.0
#: Join-time reads under way at once for one gateway: a listing of 1,000 new nodes is not 2,000
#: requests at once, and one gateway's new nodes never wait for another's.
JOIN_READS_AT_ONCE = 16

T = TypeVar("T")


@dataclass
class NodeChange:
    """The nodes that joined and left one target's gateway at one reading, by name."""

    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


@dataclass
class _Reading:
    """One finished reading of a gateway: its list (None: it could not be read) and the listed
    nodes whose join-time facts are known, by name, in the listing's order."""

    gateway: str
    listed: WorkerList | None
    nodes: dict[str, NodeConfig] = field(default_factory=dict)


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
        #: Each target's listed workers not taken as nodes at its last reading, by why.
        self.refused: dict[str, dict[str, int]] = {}
        #: Failed reads, counted by target, node and read.
        self.trouble = ReadTrouble()
        self._read_at: dict[str, float] = {}  # time.monotonic() of each target's last reading
        self._rounds: dict[str, asyncio.Task[_Reading]] = {}  # each target's reading under way
        self._circuit_reads: dict[str, asyncio.Task[None]] = {}
        self._joining: dict[tuple[str, str], asyncio.Task[NodeConfig]] = {}  # by (target, node)
        self._join_slots: dict[str, asyncio.Semaphore] = {}

    @property
    def failures(self) -> dict[tuple[str, str, str], int]:
        """Failed reads by (target, node, read) (:class:`ReadTrouble`), as the metrics read them."""
        return self.trouble.failures

    def take_up(self, configured: Settings) -> Settings:
        """Take ``configured`` (a reloaded file) as the file's settings; return it with the nodes
        found so far merged in. A target that no longer names the same gateway forgets what it
        found there (and its readings under way), and its new gateway is read at the next tick."""
        before = {t.name: t.sglang_router for t in self.configured.targets}
        self.configured = configured
        gateways = {t.name: t.sglang_router for t in configured.targets if t.sglang_router}
        known = {*self.found, *self._rounds, *self._circuit_reads, *self.refused, *self._read_at}
        for name in known | {target for target, _, _ in self.trouble.failures}:
            if gateways.get(name) != before.get(name) or name not in gateways:
                self._forget(name)
        return self.merged()

    def _forget(self, name: str) -> None:
        for table in (self.found, self.health, self.circuits, self.refused, self._read_at):
            table.pop(name, None)
        for task in (self._rounds.pop(name, None), self._circuit_reads.pop(name, None)):
            if task is not None:
                task.cancel()
        for key in [key for key in self._joining if key[0] == name]:
            self._joining.pop(key).cancel()
        self._join_slots.pop(name, None)
        self.trouble.forget(name)

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
        """Start a reading of every gateway that is due and has none under way, wait for the
        readings under way at most ``ROUND_WAIT_SECONDS``, and take up those that finished (this
        call's or earlier ones'); return each target whose nodes changed."""
        now = time.monotonic()
        for target in self.configured.targets:
            if target.sglang_router is None or target.name in self._rounds:
                continue
            if now - self._read_at.get(target.name, float("-inf")) >= target.discovery_interval_seconds:
                self._read_at[target.name] = now
                self._rounds[target.name] = asyncio.create_task(self._round(target))
        if self._rounds:
            await asyncio.wait(list(self._rounds.values()), timeout=ROUND_WAIT_SECONDS)
        changes: dict[str, NodeChange] = {}
        for name, task in list(self._rounds.items()):
            if task.done():
                del self._rounds[name]
                if (change := self._take(name, task.result())) is not None:
                    changes[name] = change
        return changes

    async def _round(self, target: TargetConfig) -> _Reading:
        """Read one gateway's list and its new nodes' join-time facts; never raise (a failure is
        counted and logged: the reading is then of an unreadable gateway)."""
        gateway = target.sglang_router
        assert gateway is not None  # refresh() reads only targets that name a gateway
        try:
            listed = await self._timed(
                target, read_workers(self._http, gateway, self._bound(target), self._limits)
            )
            self.trouble.succeeded(target.name, "", "workers")
            return _Reading(gateway, listed, await self._known(target, listed.nodes))
        except Exception as exc:  # GatewayUnreadable says why; anything else is the answer's doing
            kept = len(self.found.get(target.name, []))
            why = f"{_why(exc)}; its {kept} last known node(s) kept"
            self.trouble.failed(target.name, "", "workers", why)
            return _Reading(gateway, None)

    def _take(self, name: str, reading: _Reading) -> NodeChange | None:
        """Take up a finished reading; return what changed, or None (unchanged, unreadable, or a
        target that no longer names the gateway it read)."""
        target = self.configured.target(name)
        if target is None or target.sglang_router != reading.gateway:
            return None
        listed = reading.listed
        if listed is None:  # counted and logged as it failed; the last known nodes stay
            return None
        after, claimed = self._unclaimed(name, reading.nodes)
        self.health[name] = listed.healthy
        self._note_refused(target, listed, claimed)
        self._read_circuits(target, listed.nodes)
        self.trouble.keep(name, {node.name for node in listed.nodes})
        before = {node.name: node for node in self.found.get(name, [])}
        if before == after and name in self.found:
            return None
        self.found[name] = list(after.values())
        change = NodeChange(
            joined=[node for node, config in after.items() if before.get(node) != config],
            left=[node for node in before if node not in after],
        )
        for node in change.joined:
            log.info("node %s joined gateway %s (target %s)", node, reading.gateway, name)
        for node in change.left:
            log.warning("node %s left gateway %s (target %s)", node, reading.gateway, name)
        return change if change.joined or change.left else None

    def _unclaimed(self, name: str, nodes: dict[str, NodeConfig]) -> tuple[dict[str, NodeConfig], list[str]]:
        """Split a reading's nodes into those at a URL the file gives no other target, and the URLs
        of the rest (another target's base URL, a node it lists, a gateway API base it maps). The
        file's word on a URL outranks a gateway's: a gateway cannot take another target's node into
        its own, where that node's records would be judged, and its leaks quarantine, under the
        wrong target. (Two gateways listing one worker both take it, as they both route to it.)"""
        taken = routes_of(self.configured)
        kept: dict[str, NodeConfig] = {}
        claimed: list[str] = []
        for node_name, node in nodes.items():
            url = node.info_url or ""  # a listed worker's node always has its URL
            if taken.get(api_base_key(url), (name, ""))[0] == name:
                kept[node_name] = node
            else:
                claimed.append(url)
        return kept, claimed

    def _note_refused(self, target: TargetConfig, listed: WorkerList, claimed: list[str]) -> None:
        """Keep the workers the listing named that are no nodes of this target, by why (``claimed``:
        the URLs another target routes); log when that changes."""
        refused = dict(sorted((listed.refused + collections.Counter(claimed=len(claimed))).items()))
        if refused and refused != self.refused.get(target.name):
            why = ", ".join(f"{n} {reason}" for reason, n in refused.items())
            example = listed.example or (claimed[0] if claimed else "no URL")
            log.warning("%s: gateway %s lists %d worker(s) kvcanary does not take as nodes (%s; the first: "
                        "%s): see kvcanary_gateway_workers_refused", target.name, target.sglang_router,
                        listed.skipped + len(claimed), why, example)  # fmt: skip
        self.refused[target.name] = refused

    def _read_circuits(self, target: TargetConfig, nodes: list[NodeConfig]) -> None:
        """Start reading the gateway's circuit breakers, where the target names its metrics page
        and no reading of it is under way; it lands in :attr:`circuits` when it finishes, and an
        unreadable page leaves none (a stale state would say a breaker is closed that may not be)."""
        page = target.sglang_router_metrics
        if page is None:
            self.circuits.pop(target.name, None)
        elif target.name not in self._circuit_reads:
            task = asyncio.create_task(self._circuits_of(target, page, nodes))
            self._circuit_reads[target.name] = task
            task.add_done_callback(lambda done: self._circuits_read(target.name, done))

    def _circuits_read(self, name: str, done: asyncio.Task[None]) -> None:
        if self._circuit_reads.get(name) is done:  # not one a reload cancelled and replaced
            del self._circuit_reads[name]

    async def _circuits_of(self, target: TargetConfig, page: str, nodes: list[NodeConfig]) -> None:
        try:
            states = await self._timed(
                target, read_circuits(self._http, page, nodes, self._bound(target), self._limits)
            )
        except Exception as exc:  # GatewayUnreadable says why; anything else is the page's doing
            self.circuits.pop(target.name, None)
            self.trouble.failed(target.name, "", "metrics", _why(exc))
            return
        now = self.configured.target(target.name)
        if now is not None and now.sglang_router_metrics == page:  # not moved by a reload meanwhile
            self.circuits[target.name] = states
            self.trouble.succeeded(target.name, "", "metrics")

    async def _known(self, target: TargetConfig, listed: list[NodeConfig]) -> dict[str, NodeConfig]:
        """Return the listed nodes whose join-time facts are known, by name: a node seen before
        keeps its own (its ranks, unless the gateway lists them as ``URL@rank``, and whether it
        refuses requests without a key); a new prefill or decode node is read (:meth:`_join`), and
        one whose reads are still under way after ``JOIN_WAIT_SECONDS`` is left to a later reading."""
        before = {node.name: node for node in self.found.get(target.name, [])}
        known: dict[str, NodeConfig] = {}
        waiting: dict[str, asyncio.Task[NodeConfig]] = {}
        for node in listed:
            seen = before.get(node.name)
            if seen is not None:
                ranks = node.dp_size if node.dp_size != 1 else seen.dp_size
                known[node.name] = node.model_copy(
                    update={"dp_size": ranks, "refuses_without_key": seen.refuses_without_key}
                )
            elif node.role in ("prefill", "decode"):
                key = (target.name, node.name)
                if key not in self._joining:
                    self._joining[key] = asyncio.create_task(self._join(target, node))
                waiting[node.name] = self._joining[key]
            else:
                known[node.name] = node
        names = {node.name for node in listed}
        for key in [key for key in self._joining if key[0] == target.name and key[1] not in names]:
            self._joining.pop(key).cancel()  # no longer listed: it does not join
        if waiting:
            await asyncio.wait(waiting.values(), timeout=JOIN_WAIT_SECONDS)
        for name, task in waiting.items():
            if task.done():
                known[name] = task.result()
                self._joining.pop((target.name, name), None)
        return {node.name: known[node.name] for node in listed if node.name in known}

    async def _join(self, target: TargetConfig, node: NodeConfig) -> NodeConfig:
        """Return ``node`` with what is asked of it when it joins: its data-parallel ranks (where the
        listing did not say them) and whether it refuses requests without a credential. A read
        that fails is counted and taken as one rank, no refusal. Never raises."""
        slots = self._join_slots.setdefault(target.name, asyncio.Semaphore(JOIN_READS_AT_ONCE))
        async with slots:
            ranks: Awaitable[int] = (
                self._isolated(target, node, "server_info", read_dp_size, 1)
                if node.dp_size == 1
                else _value(node.dp_size)
            )
            dp_size, refuses = await asyncio.gather(
                ranks, self._isolated(target, node, "models", refuses_without_key, False)
            )
        if refuses and not target.credential_scope().allows(node.info_url or ""):
            log.warning("%s: node %s, listed by gateway %s outside the credential scope, refuses "
                        "requests without a key: its pairs are not probed (credential_hosts names the "
                        "hosts that may have one)", target.name, node.name, target.sglang_router)  # fmt: skip
        return node.model_copy(update={"dp_size": dp_size, "refuses_without_key": refuses})

    async def _isolated(
        self,
        target: TargetConfig,
        node: NodeConfig,
        read: str,
        reader: Callable[[HttpClient, NodeConfig, float, Limits], Awaitable[T]],
        default: T,
    ) -> T:
        """Return what ``reader`` reads of ``node``, time-boxed; ``default`` where it fails (counted)."""
        try:
            value = await self._timed(target, reader(self._http, node, self._bound(target), self._limits))
        except Exception as exc:  # NodeUnreadable says why; anything else is the node's answer's doing
            self.trouble.failed(target.name, node.name, read, _why(exc))
            return default
        self.trouble.succeeded(target.name, node.name, read)
        return value

    def _bound(self, target: TargetConfig) -> float:
        return min(READ_SECONDS, target.timeout_seconds)

    async def _timed(self, target: TargetConfig, work: Awaitable[T]) -> T:
        """Await ``work`` for at most one read's bound, whatever the reader itself waits for."""
        async with asyncio.timeout(self._bound(target)):
            return await work


def _why(exc: Exception) -> str:
    """Say why a read failed in words fit for a log: the message of the reads' own exceptions, the
    type of any other (whose message may quote what a gateway or node wrote)."""
    if isinstance(exc, GatewayUnreadable | NodeUnreadable):
        return str(exc)[:300]
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return type(exc).__name__


async def _value(value: T) -> T:
    return value
