"""The quarantine set as a tap reads it: the monitor's document (``docs/tap-protocol.md``,
"Quarantine"), the payload of the signed envelope ``signed.py`` opens, parsed whole or refused
whole into what a request's lookup reads, with what orders it among the sets the monitors signed
(its ``revision``, when it was generated, when it expires). Standard library only: this runs inside
the gateway's process."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvcanary.tap.record import printable_name

#: The one version of the document this tap reads; another is refused (the last set is kept).
VERSION = 2
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
    #: The newest quarantine change the monitor read it at (-1: no set read yet), and when it was
    #: generated and expires (epoch seconds): what orders it among the monitors' sets.
    revision: int = -1
    generated: float = 0.0
    expires: float = math.inf
    expires_at: str = ""
    #: The id of the key that signed it ("" before a signed set was read).
    key_id: str = ""

    @property
    def empty(self) -> bool:
        return not self.enforced and not self.observed and not self.guards

    def same_content(self, other: QuarantineSet) -> bool:
        """Whether ``other`` quarantines, observes and guards exactly what this set does."""
        return (self.enforced, self.observed, self.guards) == (other.enforced, other.observed, other.guards)


EMPTY = QuarantineSet()


def parse_quarantine(body: bytes) -> QuarantineSet:
    """Return the set a signed envelope's payload holds (``signed.py`` checked the signature); raise
    ValueError for anything not the contract's (a whole set or none: a set read in part would lift
    the quarantine of what it left out)."""
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
    revision = document.get("revision")
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 0:
        raise ValueError("'revision' is not a whole number")
    generated_at, expires_at = document.get("generated_at"), document.get("expires_at")
    generated, expires = _instant(generated_at, "generated_at"), _instant(expires_at, "expires_at")
    if expires <= generated:
        raise ValueError("'expires_at' is not after 'generated_at'")
    return QuarantineSet(
        enforced, observed, printable_name(generated_at), guards,
        revision=revision, generated=generated, expires=expires, expires_at=printable_name(expires_at),
    )  # fmt: skip


def _instant(value: Any, name: str) -> float:
    """Return an ISO-8601 time with its offset as epoch seconds; raise ValueError."""
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise ValueError(f"'{name}' is not an ISO-8601 time with its offset")
    return when.timestamp()


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
