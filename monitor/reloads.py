"""How the running monitor takes up new settings without a restart: read again from its file
(SIGHUP, ``POST /-/reload``) or the file in force with the nodes its SGLang gateways list now
(``monitor/runs/discovery.py``).

A new configuration is refused whole (logged, ``kvcanary_config_reload_success`` 0, the settings in
force stay) when it does not load or changes a key only a restart can. Otherwise the plan
(``config/reload_plan.py``) says what changed, and this module applies it to the monitor's parts in one
step: clients of added and changed targets made (old ones closed once their runs in flight end),
their series dropped, every part handed the new settings, probe jobs removed and added, joined and
left nodes audited at once. Runs in flight, open incidents, states and the spool stay.

The caller holds the monitor's reload lock: a SIGHUP, a POST and a gateway's change come one after
the other, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
    from kvcanary.monitor.app import Monitor
    from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget

log = logging.getLogger("kvcanary")

Keys = TenantKeys


async def take_up_file(monitor: Monitor, why: str) -> str | None:
    """Read the config file again and take it up; return None, or why it was refused."""
    try:
        if monitor.config_path is None:
            raise ConfigError("no config file to reload from")
        new = load_settings(monitor.config_path)
        old = monitor.settings
        restart = restart_needed(old, new) + old.traffic.restart_keys(new.traffic)
        if restart:
            raise ConfigError(f"{monitor.config_path}: {restart[0]}: cannot change on reload; restart")
        keys = tenant_keys(new)
        signer_of(new)  # a signing key the new settings need is readable, or the reload is refused
    except ConfigError as exc:
        monitor.metrics.reload_ok.set(0)
        log.error("reload (%s) refused, the configuration in force stays: %s", why, exc)
        return str(exc)
    await _apply(monitor, new, keys, why)
    return None


async def take_up_nodes(monitor: Monitor) -> None:
    """Take up the file in force with the nodes its gateways list now."""
    await _apply(
        monitor, monitor.discovery.configured, monitor.tenant_keys, "nodes found from a gateway changed"
    )


async def _apply(monitor: Monitor, new: Settings, keys: Keys, why: str) -> None:
    new = monitor.discovery.take_up(new)
    old_keys = monitor.tenant_keys
    # A rotated key file (a tenant's or the workers') replaces the target's client.
    rekeyed = frozenset(t for (t, tenant), key in keys.items() if old_keys.get((t, tenant), key) != key)
    rekeyed |= {t for t, key in keys.workers.items() if old_keys.workers.get(t, key) != key}
    change = plan(monitor.settings, new, rekeyed)
    monitor.tenant_keys = keys
    old_clients = _swap_clients(monitor, new, keys, change)
    monitor.settings = monitor.runner.settings = monitor.recorder.settings = new
    if monitor.pager is not None:
        monitor.pager.settings = new
    monitor.runner.take_up(new)
    monitor.traffic.judge.take_up(new, changed=change.removed + change.changed)
    monitor.traffic.judge.own_keys = own_key_digests(keys)
    _reschedule(monitor, new, change)
    await asyncio.to_thread(monitor.recorder.ensure_targets, new.targets)
    for client in old_clients:  # closed once their runs in flight are over
        asyncio.get_running_loop().create_task(monitor.runner.close_when_idle(client))
    for listener in monitor.on_reload:
        listener(new)
    # A containment policy or admission guard that changed takes effect now, not at the next round
    # (the settings are in force already: a failure here is said, and the next round tries again).
    try:
        await monitor.containment.take_up()
    except Exception:
        log.exception("reload: containment and the admission guard take it up at their next round")
    monitor.metrics.reload_ok.set(1)
    monitor.metrics.reload_ok_at.set(time.time())
    log.info("reloaded %s (%s): %s", monitor.config_path, why, change.summary())


def _swap_clients(monitor: Monitor, new: Settings, keys: Keys, change: ReloadPlan) -> list[OpenAIHttpTarget]:
    """Make the clients of added and changed targets; drop the series of changed and removed ones.
    Return the clients replaced, to close once idle."""
    old = [monitor.clients.pop(n) for n in change.removed + change.changed]
    for name in change.added + change.changed:
        monitor.clients[name] = monitor.client_of(new.target(name), keys)  # type: ignore[arg-type]
    for name in change.removed + change.changed:
        # Only its node series go when only its nodes changed: the other kinds' figures stand.
        monitor.metrics.forget(name, node_kinds(new, name) if name in change.nodes_only else None)
    for name in change.removed:
        monitor.metrics.forget_removed(name)
    return old


def _reschedule(monitor: Monitor, new: Settings, change: ReloadPlan) -> None:
    scheduler = monitor.scheduler
    for target, kind in change.jobs_removed:
        with contextlib.suppress(JobLookupError):
            scheduler.remove_job(probe_job_id(target, kind))
    add_probe_jobs(scheduler, new, monitor.runner, change.jobs_added, monitor.membership.owns)
    # A node that joined is audited now, not an interval later; one that left took the node
    # series of its target with it (above), which its remaining nodes' audits give back now.
    for name in dict.fromkeys(target for target, _ in change.nodes_joined + change.nodes_left):
        run_now(scheduler, name, node_kinds(new, name))


def node_kinds(settings: Settings, name: str) -> list[str]:
    """The kinds of ``name`` that run per node (its audits)."""
    target = settings.target(name)
    return [k for k in target.probes if REGISTRY[k].scope == "node"] if target is not None else []
