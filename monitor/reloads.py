"""How the running monitor takes up new settings without a restart: read again from its file
(SIGHUP, ``POST /-/reload``) or the file in force with the nodes its SGLang gateways list now
(``monitor/runs/discovery.py``).

A new configuration is refused whole (logged, ``kvcanary_config_reload_success`` 0, the settings in
force stay) when it does not load or changes a key only a restart can. Otherwise the plan
(``config/reload_plan.py``) says what changed, and the :class:`Reloader` applies it in one step to the
parts it was handed when the monitor was built: clients of added and changed targets made (old ones
closed once their runs in flight end), their series dropped, every part handed the new settings,
probe jobs removed and added, joined and left nodes audited at once. Runs in flight, open
incidents, states and the spool stay. A SIGHUP, a POST and a gateway's change come one after the
other, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from apscheduler.jobstores.base import JobLookupError

from kvcanary.monitor.config.reload_plan import ReloadPlan, plan, restart_needed
from kvcanary.monitor.config.secrets import TenantKeys, tenant_keys
from kvcanary.monitor.config.settings import ConfigError, Settings, load_settings
from kvcanary.monitor.containment.signing import signer_of
from kvcanary.monitor.runs.scheduler import add_probe_jobs, probe_job_id, run_now
from kvcanary.monitor.traffic.judge import own_key_digests
from kvcanary.probes import REGISTRY

if TYPE_CHECKING:
    from pathlib import Path

    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    from kvcanary.monitor.config.targets import TargetConfig
    from kvcanary.monitor.containment import Containment
    from kvcanary.monitor.metrics.registry import MonitorMetrics
    from kvcanary.monitor.paging.pager import Pager
    from kvcanary.monitor.recording.recorder import Recorder
    from kvcanary.monitor.runs.discovery import GatewayDiscovery, NodeChange
    from kvcanary.monitor.runs.runner import ProbeRunner
    from kvcanary.monitor.runs.scheduler import Owns
    from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
    from kvcanary.monitor.traffic.judge import TrafficJudge

log = logging.getLogger("kvcanary")


@dataclass
class InForce:
    """The settings and tenant keys in force: what the parts that follow a reload read, and what
    only the :class:`Reloader` replaces."""

    settings: Settings
    keys: TenantKeys


class Reloader:
    """The one way the settings in force change while the monitor runs.

    ``clients`` is the targets' clients by name, shared with the runner, the judge and containment
    (replaced here in place); ``client_of`` makes a target's client with its keys; ``listeners``
    are called with the new settings after each reload that took (the HTTP app's state).
    """

    def __init__(
        self,
        in_force: InForce,
        *,
        config_path: Path | None,
        clients: MutableMapping[str, OpenAIHttpTarget],
        client_of: Callable[[TargetConfig, TenantKeys], OpenAIHttpTarget],
        runner: ProbeRunner,
        recorder: Recorder,
        judge: TrafficJudge,
        pager: Pager | None,
        containment: Containment,
        discovery: GatewayDiscovery,
        scheduler: AsyncIOScheduler,
        owns: Owns,
        metrics: MonitorMetrics,
        listeners: list[Callable[[Settings], None]],
    ):
        self.in_force = in_force
        self.config_path = config_path
        self.clients = clients
        self.client_of = client_of
        self.runner = runner
        self.recorder = recorder
        self.judge = judge
        self.pager = pager
        self.containment = containment
        self.discovery = discovery
        self.scheduler = scheduler
        self.owns = owns
        self.metrics = metrics
        self.listeners = listeners
        self._lock = asyncio.Lock()

    async def take_up_file(self, why: str) -> str | None:
        """Read the config file again and take it up; return None, or why it was refused."""
        async with self._lock:
            try:
                new, keys = self._read_file()
            except ConfigError as exc:
                self.metrics.reload_ok.set(0)
                log.error("reload (%s) refused, the configuration in force stays: %s", why, exc)
                return str(exc)
            await self._apply(new, keys, why)
            return None

    async def take_up_nodes(self, changes: Mapping[str, NodeChange]) -> None:
        """Take up the file in force with the nodes its gateways list now (``changes``, by target)."""
        async with self._lock:
            # Counted under the lock, for targets still configured: a reload that removed one
            # while its gateway was read has dropped its series, not to be made again.
            for target, change in changes.items():
                if self.discovery.configured.target(target) is not None:
                    self.metrics.gateway_node_changes.labels(target, "joined").inc(len(change.joined))
                    self.metrics.gateway_node_changes.labels(target, "left").inc(len(change.left))
            why = "nodes found from a gateway changed"
            await self._apply(self.discovery.configured, self.in_force.keys, why)

    def _read_file(self) -> tuple[Settings, TenantKeys]:
        """Return the file's settings and their tenant keys; raise ConfigError where they cannot be
        taken up (unreadable, a restart-only key changed, a key or the signing key unreadable)."""
        if self.config_path is None:
            raise ConfigError("no config file to reload from")
        new = load_settings(self.config_path)
        old = self.in_force.settings
        restart = restart_needed(old, new) + old.traffic.restart_keys(new.traffic)
        if restart:
            raise ConfigError(f"{self.config_path}: {restart[0]}: cannot change on reload; restart")
        keys = tenant_keys(new)
        signer_of(new)  # a signing key the new settings need is readable, or the reload is refused
        return new, keys

    async def _apply(self, new: Settings, keys: TenantKeys, why: str) -> None:
        new = self.discovery.take_up(new)
        # A rotated key file (a tenant's or the workers') replaces the target's client.
        old = self.in_force
        rekeyed = frozenset(t for (t, tenant), key in keys.items() if old.keys.get((t, tenant), key) != key)
        rekeyed |= {t for t, key in keys.workers.items() if old.keys.workers.get(t, key) != key}
        change = plan(old.settings, new, rekeyed)
        old_clients = self._swap_clients(new, keys, change)
        self.in_force.settings, self.in_force.keys = new, keys
        self.recorder.settings = new
        if self.pager is not None:
            self.pager.settings = new
        self.runner.take_up(new)
        self.judge.take_up(new, changed=change.removed + change.changed)
        self.judge.own_keys = own_key_digests(keys)
        self._reschedule(new, change)
        await asyncio.to_thread(self.recorder.ensure_targets, new.targets)
        for client in old_clients:  # closed once their runs in flight are over
            asyncio.get_running_loop().create_task(self.runner.close_when_idle(client))
        for listener in self.listeners:
            listener(new)
        # A containment policy or admission guard that changed takes effect now, not at the next round
        # (the settings are in force already: a failure here is said, and the next round tries again).
        try:
            await self.containment.take_up()
        except Exception:
            log.exception("reload: containment and the admission guard take it up at their next round")
        self.metrics.reload_ok.set(1)
        self.metrics.reload_ok_at.set(time.time())
        log.info("reloaded %s (%s): %s", self.config_path, why, change.summary())

    def _swap_clients(self, new: Settings, keys: TenantKeys, change: ReloadPlan) -> list[OpenAIHttpTarget]:
        """Make the clients of added and changed targets; drop the series of changed and removed ones.
        Return the clients replaced, to close once idle."""
        old = [self.clients.pop(n) for n in change.removed + change.changed]
        for name in change.added + change.changed:
            self.clients[name] = self.client_of(new.target(name), keys)  # type: ignore[arg-type]
        for name in change.removed + change.changed:
            # Only its node series go when only its nodes changed: the other kinds' figures stand.
            self.metrics.forget(name, node_kinds(new, name) if name in change.nodes_only else None)
        for name in change.removed:
            self.metrics.forget_removed(name)
        return old

    def _reschedule(self, new: Settings, change: ReloadPlan) -> None:
        for target, kind in change.jobs_removed:
            with contextlib.suppress(JobLookupError):
                self.scheduler.remove_job(probe_job_id(target, kind))
        add_probe_jobs(self.scheduler, new, self.runner, change.jobs_added, self.owns)
        # A node that joined is audited now, not an interval later; one that left took the node
        # series of its target with it (above), which its remaining nodes' audits give back now.
        for name in dict.fromkeys(target for target, _ in change.nodes_joined + change.nodes_left):
            run_now(self.scheduler, name, node_kinds(new, name))


def node_kinds(settings: Settings, name: str) -> list[str]:
    """The kinds of ``name`` that run per node (its audits)."""
    target = settings.target(name)
    return [k for k in target.probes if REGISTRY[k].scope == "node"] if target is not None else []
