"""The monitor's quarantine as a gateway holds it (issue 36): the deployments a leak was found on,
which every replica of the gateway stops routing customers to within two seconds.

:class:`QuarantineWatch` reads ``GET {monitor}/api/v1/quarantine`` (``docs/tap-protocol.md``,
"Quarantine") every ``poll_seconds`` on a daemon thread of its own and swaps the set it read in
whole: a request's lookup (:meth:`QuarantineWatch.snapshot`) reads memory only and never waits for
the monitor. An answer that is not a readable 200 (a timeout, a refused connection, a 401, a body
over ``MAX_BODY_BYTES`` or not the contract's) keeps the last known set: a monitor that cannot be
reached must neither lift a quarantine nor impose one. Losing the monitor is logged once and
finding it again once, never once a poll; each change of the set is logged once.

A gateway that forks after building its watch (gunicorn ``--preload``) gets a working one in each
child, as the tap's sender does (``os.register_at_fork``): the child keeps the set it inherited
(the last known one), takes a new lock, and starts its own poller on its first lookup.

Standard library only: this runs inside the gateway's process.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from typing import Any

from kvcanary.tap import TapConfigError, _secret
from kvcanary.tap.gateway_metrics import gateway_gauge
from kvcanary.tap.http import _OPENER
from kvcanary.tap.record import printable_name
from kvcanary.wire import QUARANTINE_BUCKET, api_base_key

log = logging.getLogger("kvcanary.tap")

#: The one version of the answer this tap reads; another is refused (the last set is kept).
VERSION = 1
#: The most of an answer read: a set of thousands of deployments fits many times over.
MAX_BODY_BYTES = 1024 * 1024
#: How long one read may take: a poll that hangs must not hold the set older than a poll or two.
READ_TIMEOUT_SECONDS = 2.0
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
    """One guarded target's admission facts (``kvcanary/tap/admission.py`` applies them)."""

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


class QuarantineWatch:
    """The last quarantine set read from the monitor, kept fresh by a daemon thread (module doc)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        poll_seconds: float = 1.0,
        timeout_seconds: float = READ_TIMEOUT_SECONDS,
        start: bool = True,
    ):
        """``url``: the monitor's base URL; ``start``: begin polling now (else on the first lookup)."""
        self.url = url.rstrip("/") + "/api/v1/quarantine"
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        #: Swapped whole by the poller; a lookup reads this one attribute.
        self.current: QuarantineSet = EMPTY
        #: Epoch seconds of the last answer taken, None before the first.
        self.last_read_at: float | None = None
        #: Whether the last read failed (the set is then the last known one).
        self.failing = False
        self._closed = False
        self._start_afresh()
        _WATCHES.add(self)
        _export_failing()
        if start:
            self._start_polling()

    def _start_afresh(self) -> None:
        """A new lock, stop flag and thread, not started yet: a new watch's, and a forked child's
        (nothing of the parent's thread or locks is the child's)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvcanary-quarantine", daemon=True)
        self._needs_start = not self._closed

    def snapshot(self) -> QuarantineSet:
        """Return the set as last read: memory only, never the network. Starts this process's
        poller if it has none yet (a forked child's first lookup)."""
        if self._needs_start:
            self._start_polling()
        return self.current

    def quarantined(self, api_base: str) -> QuarantineEntry | None:
        """Return the enforced entry of a deployment's ``api_base`` (as the gateway spells it), or
        None: route to it."""
        return self.snapshot().enforced.get(api_base_key(api_base))

    def observed(self, api_base: str) -> QuarantineEntry | None:
        """Return the observe-mode entry of a deployment's ``api_base``: count it, route to it."""
        return self.snapshot().observed.get(api_base_key(api_base))

    def close(self, timeout: float = 5.0) -> None:
        """Stop polling; the last set stays readable."""
        with self._lock:
            self._closed = True
            self._needs_start = False
            self._stop.set()
            started = self._thread.ident is not None
        if started:
            self._thread.join(timeout)

    def _start_polling(self) -> None:
        with self._lock:
            if self._needs_start:
                self._needs_start = False
                self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.poll_once()
            except Exception:  # the poller outlives anything; the set stays the last known
                log.exception("kvcanary tap: cannot read the quarantine")
            self._stop.wait(max(0.0, self.poll_seconds - (time.monotonic() - began)))

    def poll_once(self) -> bool:
        """Read the monitor's set once and swap it in; return False (and keep the last set) when
        the answer cannot be taken."""
        try:
            found = parse_quarantine(self._read())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._note_failure(exc)
            return False
        _log_changes(self.current, found)
        self.current = found
        self.last_read_at = time.time()
        if self.failing:
            self.failing = False
            log.warning("kvcanary tap: the quarantine is read from the monitor again")
        return True

    def _read(self) -> bytes:
        """Return a 200 answer's body; raise OSError (no answer) or ValueError (another status, or
        a body over ``MAX_BODY_BYTES``)."""
        request = urllib.request.Request(self.url, headers=self._headers, method="GET")
        try:
            with _OPENER.open(request, timeout=self.timeout_seconds) as answer:
                if answer.status != 200:
                    raise ValueError(f"the monitor answered {answer.status}")
                body: bytes = answer.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise ValueError(f"the monitor answered {exc.code}") from None
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"the answer is over {MAX_BODY_BYTES} bytes")
        return body

    def _note_failure(self, exc: Exception) -> None:
        if self.failing:
            return  # once per outage, not once a poll
        self.failing = True
        held = self.current
        log.warning(
            "kvcanary tap: cannot read the quarantine from %s (%s); keeping the last known set "
            "(%d deployment(s) quarantined, %d observed)",
            self.url, exc, len(held.enforced), len(held.observed),
        )  # fmt: skip

    def _after_fork_in_child(self) -> None:
        self._start_afresh()


def _log_changes(before: QuarantineSet, after: QuarantineSet) -> None:
    """Log each deployment that entered or left the set (once per change, not per poll)."""
    for mode, old, new in (("quarantined", before.enforced, after.enforced),
                           ("observed (not filtered)", before.observed, after.observed)):  # fmt: skip
        for key in new.keys() - old.keys():
            log.warning("kvcanary tap: deployment %s %s by kvcanary: %s", key, mode, new[key].describe())
        for key in old.keys() - new.keys():
            log.warning("kvcanary tap: deployment %s no longer %s", key, mode)


def _export_failing() -> None:
    """The gateway's gauge ``kvcanary_tap_quarantine_unreadable``: 1 while a watch of this process
    that is not closed cannot read the set (the last known one is applied), 0 otherwise."""
    gateway_gauge(
        "kvcanary_tap_quarantine_unreadable",
        "1 while kvcanary's quarantine set cannot be read from the monitor (or its NATS bucket): the "
        "gateway applies the last set it read.",
        lambda: float(any(w.failing and not w._closed for w in list(_WATCHES))),
    )


def watch_from_env() -> QuarantineWatch | None:
    """Return a started watch when ``KVCANARY_TAP_QUARANTINE`` is on, else None; raise
    :class:`TapConfigError` naming a wrong variable (``docs/tap-protocol.md``, "Quarantine").

    The monitor is ``KVCANARY_TAP_QUARANTINE_URL``, else ``KVCANARY_TAP_URL`` when that is the
    monitor's (http, https); the token ``KVCANARY_TAP_QUARANTINE_TOKEN(_FILE)``, else the tap's.
    Where the tap's records go to NATS and no quarantine URL is set, the set is watched in the
    monitors' KV bucket (``KVCANARY_TAP_QUARANTINE_BUCKET``, ``kvcanary/tap/quarantine_bucket.py``)
    with the tap's own NATS credentials."""
    switch = os.environ.get("KVCANARY_TAP_QUARANTINE", "").strip().lower()
    if switch in ("", "0", "false", "off", "no"):
        return None
    if switch not in ("1", "true", "on", "yes"):
        raise TapConfigError(
            "KVCANARY_TAP_QUARANTINE: 1 to keep quarantined deployments out of routing, or 0"
        )
    tap_url = os.environ.get("KVCANARY_TAP_URL", "").strip()
    own_url = os.environ.get("KVCANARY_TAP_QUARANTINE_URL", "").strip()
    url = own_url or tap_url
    if not own_url and tap_url.startswith(("nats://", "tls://")):
        return _bucket_watch(tap_url)
    if not url.startswith(("http://", "https://")):
        raise TapConfigError(
            "KVCANARY_TAP_QUARANTINE_URL: set it to the monitor's URL (http://host:port) where "
            "KVCANARY_TAP_URL is not the monitor's"
        )
    token = _secret("KVCANARY_TAP_QUARANTINE_TOKEN")
    if token is None and (own_url in ("", tap_url)):
        token = _secret("KVCANARY_TAP_TOKEN")
    if token is None:
        raise TapConfigError(
            "KVCANARY_TAP_QUARANTINE_TOKEN: set it (or KVCANARY_TAP_QUARANTINE_TOKEN_FILE) to the "
            "monitor's ingest token"
        )
    return QuarantineWatch(url, token, poll_seconds=_poll_env())


def _bucket_watch(servers: str) -> QuarantineWatch:
    from kvcanary.tap.quarantine_bucket import BucketWatch  # nats-py: only where records go to NATS

    bucket = os.environ.get("KVCANARY_TAP_QUARANTINE_BUCKET", "").strip() or QUARANTINE_BUCKET
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", bucket):
        raise TapConfigError("KVCANARY_TAP_QUARANTINE_BUCKET: a bucket name (letters, digits, _ and -)")
    user = os.environ.get("KVCANARY_TAP_NATS_USER", "").strip() or None
    token = _secret("KVCANARY_TAP_TOKEN")
    return BucketWatch(servers, token, user=user, bucket=bucket, poll_seconds=_poll_env())


def _poll_env() -> float:
    """Return ``KVCANARY_TAP_QUARANTINE_POLL_SECONDS`` (default 1): how often the set is read."""
    text = os.environ.get("KVCANARY_TAP_QUARANTINE_POLL_SECONDS", "").strip() or "1"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.1 <= seconds <= 60:
        raise TapConfigError("KVCANARY_TAP_QUARANTINE_POLL_SECONDS: seconds from 0.1 to 60")
    return seconds


#: Every watch of this process, for the fork hook (weakly: the hook keeps no watch alive).
_WATCHES: weakref.WeakSet[QuarantineWatch] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for watch in list(_WATCHES):
        watch._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
