"""What a configuration reload changes: the difference between the settings in force and a new file.

``kvcanary serve`` reloads on SIGHUP and ``POST /-/reload`` (as Prometheus, Alertmanager and
blackbox_exporter do). A reload may add, remove or change targets and their probes, tenants,
intervals and options, alerting and incident rules; what the running process is built on (the
database, where the API listens and its token, the spool, the scheduler's slots) needs a restart,
and a file that changes it is refused as a whole, naming the key, so nothing is half-applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcanary.monitor.config.settings import Settings

#: Keys a running process cannot take up; changing one needs a restart.
RESTART_KEYS = (
    "database_url",
    "api.listen",
    "api.token_env",
    "api.token_file",
    "api.local_only",
    "spool",
    "scheduler",
    "marker_key_env",
    "marker_key_file",
    "marker_ttl_seconds",
    "limits",
    "alertmanagers",
    "alerting.timeout_seconds",
    "api.run_now_min_interval_seconds",
    "otel",  # the exporter and its thread are built at start
)


@dataclass
class ReloadPlan:
    """Targets added, removed and changed by name; (target, kind) jobs to add and to remove; and the
    (target, node) pairs that joined or left a target that stays (a file's ``nodes:`` or its gateway)."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    jobs_added: list[tuple[str, str]] = field(default_factory=list)
    jobs_removed: list[tuple[str, str]] = field(default_factory=list)
    nodes_joined: list[tuple[str, str]] = field(default_factory=list)
    nodes_left: list[tuple[str, str]] = field(default_factory=list)
    #: Changed targets whose change is their nodes alone (what a gateway's nodes change does).
    nodes_only: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{len(getattr(self, n))} {n}" for n in ("added", "removed", "changed") if getattr(self, n)]
        return ", ".join(parts) + " target(s)" if parts else "no target changed"


def _value(settings: Settings, dotted: str) -> object:
    value: object = settings
    for part in dotted.split("."):
        value = getattr(value, part)
    return value.model_dump() if hasattr(value, "model_dump") else value


def restart_needed(old: Settings, new: Settings) -> list[str]:
    """Return the keys of :data:`RESTART_KEYS` whose value differs."""
    return [key for key in RESTART_KEYS if _value(old, key) != _value(new, key)]


def plan(old: Settings, new: Settings, rekeyed: frozenset[str] = frozenset()) -> ReloadPlan:
    """Return what taking ``new`` in place of ``old`` changes, target by target and job by job;
    ``rekeyed`` targets have the same config but a tenant key that changed (a rotated key file)."""
    before = {t.name: t for t in old.targets}
    after = {t.name: t for t in new.targets}
    out = ReloadPlan(
        added=[n for n in after if n not in before],
        removed=[n for n in before if n not in after],
        changed=[n for n in after if n in before and (after[n] != before[n] or n in rekeyed)],
    )
    jobs_before = {(t.name, k): t.interval_for(k) for t in old.targets for k in t.probes}
    jobs_after = {(t.name, k): t.interval_for(k) for t in new.targets for k in t.probes}
    out.jobs_removed = [j for j in jobs_before if jobs_after.get(j) != jobs_before[j]]
    out.jobs_added = [j for j in jobs_after if jobs_before.get(j) != jobs_after[j]]
    for name in out.changed:
        nodes_before = {node.name: node for node in before[name].node_list()}
        nodes_after = {node.name: node for node in after[name].node_list()}
        # A node whose address changed is a new node to audit: its pool is another machine's.
        out.nodes_joined += [(name, n) for n, node in nodes_after.items() if nodes_before.get(n) != node]
        out.nodes_left += [(name, n) for n in nodes_before if n not in nodes_after]
        if before[name].model_copy(update={"nodes": []}) == after[name].model_copy(update={"nodes": []}):
            out.nodes_only.append(name)
    return out
