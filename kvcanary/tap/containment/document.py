"""The quarantine set as a tap reads it: the monitor's document (``docs/tap-protocol.md``,
"Quarantine") parsed whole or refused whole, into what a request's lookup reads. Standard library
only: this runs inside the gateway's process."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvcanary.tap.record import printable_name

#: The one version of the document this tap reads; another is refused (the last set is kept).
VERSION = 1
#: What a reason may keep of its characters (it reaches logs and customers' error messages).
MAX_REASON_CHARS = 200


@dataclass(frozen=True)
class QuarantineEntry:
    """One quarantined target: what a filtered request's error and the logs name."""

    target: str
    incident_id: int | None
    reason: str
    since: str
    enforced: bool

    def describe(self) -> str:
        """Return ``target 'T' (incident N): reason``, the words an error and a log line use."""
        incident = f"incident {self.incident_id}" if self.incident_id is not None else "no incident"
        return f"target {self.target!r} ({incident}): {self.reason}"


@dataclass(frozen=True)
class GuardEntry:
    """One guarded target's admission facts (``kvcanary/tap/containment/guard.py`` applies them)."""

    target: str
    enforced: bool  # False: the observe policy, count what would be refused
    kv_pool_tokens: int
    chars_per_token: float | None


@dataclass(frozen=True)
class QuarantineSet:
    """The deployments quarantined, by api_base key (``kvcanary.wire.api_base_key``): ``enforced``
    ones are kept out of routing, ``observed`` ones (the policy ``observe``) only counted; and the
    admission guard's facts by the same keys."""

    enforced: dict[str, QuarantineEntry] = field(default_factory=dict)
    observed: dict[str, QuarantineEntry] = field(default_factory=dict)
    generated_at: str = ""
    guards: dict[str, GuardEntry] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.enforced and not self.observed and not self.guards


EMPTY = QuarantineSet()


def parse_quarantine(body: bytes) -> QuarantineSet:
    """Return the set a 200 answer's body holds; raise ValueError for anything not the contract's
    (a whole answer or none: a set read in part would lift the quarantine of what it left out)."""
    document = json.loads(body)
    if not isinstance(document, dict) or document.get("version") != VERSION:
        raise ValueError(f"not a version {VERSION} quarantine answer")
    deployments = document.get("deployments")
    if not isinstance(deployments, list):
        raise ValueError("'deployments' is not a list")
    enforced: dict[str, QuarantineEntry] = {}
    observed: dict[str, QuarantineEntry] = {}
    for item in deployments:
        entry, api_bases = _entry_of(item)
        for key in api_bases:
            (enforced if entry.enforced else observed)[key] = entry
    for key in enforced:  # a deployment both enforced and observed is enforced
        observed.pop(key, None)
    guards = _guards_of(document.get("guards", []))
    return QuarantineSet(enforced, observed, printable_name(document.get("generated_at", "")), guards)


def _guards_of(items: Any) -> dict[str, GuardEntry]:
    """Return the ``guards`` of an answer by api_base key (absent: none, as from a monitor that
    predates them); raise ValueError for anything not the contract's."""
    if not isinstance(items, list):
        raise ValueError("'guards' is not a list")
    guards: dict[str, GuardEntry] = {}
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("a guard is not an object")
        target, api_bases, mode = item.get("target"), item.get("api_bases"), item.get("mode")
        pool, density = item.get("kv_pool_tokens"), item.get("chars_per_token")
        if not isinstance(target, str) or not target:
            raise ValueError("a guard has no target")
        if not isinstance(api_bases, list) or not all(isinstance(b, str) and b for b in api_bases):
            raise ValueError(f"guard of {target!r}: 'api_bases' is not a list of keys")
        if mode not in ("observe", "enforce"):
            raise ValueError(f"guard of {target!r}: 'mode' is neither observe nor enforce")
        if not isinstance(pool, int) or isinstance(pool, bool) or pool <= 0:
            raise ValueError(f"guard of {target!r}: 'kv_pool_tokens' is not a positive integer")
        if density is not None and (not isinstance(density, (int, float)) or not 0 < density < 1e6):
            raise ValueError(f"guard of {target!r}: 'chars_per_token' is not a positive number")
        entry = GuardEntry(printable_name(target), mode == "enforce", pool, density)
        guards.update(dict.fromkeys(api_bases, entry))
    return guards


def _entry_of(item: Any) -> tuple[QuarantineEntry, list[str]]:
    """Return one ``deployments`` item and its api_base keys; raise ValueError."""
    if not isinstance(item, dict):
        raise ValueError("a deployment is not an object")
    target, api_bases, incident = item.get("target"), item.get("api_bases"), item.get("incident_id")
    enforced = item.get("enforced")
    if not isinstance(target, str) or not target:
        raise ValueError("a deployment has no target")
    if not isinstance(api_bases, list) or not all(isinstance(b, str) and b for b in api_bases):
        raise ValueError(f"target {target!r}: 'api_bases' is not a list of keys")
    if incident is not None and (not isinstance(incident, int) or isinstance(incident, bool)):
        raise ValueError(f"target {target!r}: 'incident_id' is not an integer")
    if not isinstance(enforced, bool):
        raise ValueError(f"target {target!r}: 'enforced' is not a boolean")
    reason = printable_name(item.get("reason") or "a leak was found")[:MAX_REASON_CHARS]
    entry = QuarantineEntry(
        printable_name(target), incident, reason, printable_name(item.get("since") or ""), enforced
    )
    return entry, api_bases
