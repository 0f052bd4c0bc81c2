"""The monitor's quarantine as a gateway holds it: the deployments a leak was found on,
which every replica of the gateway stops routing customers to within two seconds.

:class:`QuarantineWatch` reads ``GET {monitor}/api/v1/quarantine`` (``docs/tap-protocol.md``,
"Quarantine") every ``poll_seconds`` on a daemon thread of its own, naming its gateway and the set it
holds (``Kvcanary-Gateway``, ``Kvcanary-Quarantine-Held``: the monitor counts each gateway's reads
by the key of the set it applies), and swaps in whole a set the monitors signed that is newer than
the one it holds (``signed.py``): a request's lookup (:meth:`QuarantineWatch.snapshot`) reads memory
only and never waits for the monitor.

What it does not take keeps the last set taken, and is said:

- an answer that is not a readable 200 (a timeout, a refused connection, a 401, a body over
  ``MAX_BODY_BYTES``): a monitor that cannot be reached must neither lift a quarantine nor impose
  one. Losing the monitor is logged once and finding it again once, never once a poll; the
  gateway's ``kvcanary_tap_quarantine_unreadable`` is 1 meanwhile;
- a value the monitors did not sign, or older than the set held (``signed.REASONS``): counted in
  the gateway's ``kvcanary_tap_quarantine_refused_total{reason}`` and logged at most once a
  ``REFUSAL_LOG_SECONDS`` per reason: whoever answered in the monitor's place moves no gateway;
- a set that stops moving forward: the monitors sign theirs anew every minute, so one not followed
  by a newer within ``stale_seconds``, or past its ``expires_at``, is still applied (a monitor away
  never lifts a quarantine) but said, once, and ``kvcanary_tap_quarantine_stale`` is 1.

Each change of the set is logged once.

A gateway that forks after building its watch (gunicorn ``--preload``) gets a working one in each
child, as the tap's sender does (``os.register_at_fork``): the child keeps the set it inherited
(the last known one), takes a new lock, and starts its own poller on its first lookup.

Standard library only, but for ``cryptography``'s Ed25519 (``signed.py``): this runs inside the
gateway's process.
"""

from __future__ import annotations

import collections
import http.client
import logging
import os
import threading
import time
import urllib.error
import urllib.request
import weakref

from kvcanary.tap.containment.document import (
    EMPTY,
    QuarantineEntry,
    QuarantineSet,
)
from kvcanary.tap.containment.signed import PublicKeys, Refused, describe, open_set
from kvcanary.tap.gateway_metrics import gateway_counter, gateway_gauge
from kvcanary.tap.http import _OPENER
from kvcanary.wire import GATEWAY_HEADER, QUARANTINE_HELD_HEADER, api_base_key

log = logging.getLogger("kvcanary.tap")

#: The most of an answer read: a set of thousands of deployments fits many times over.
MAX_BODY_BYTES = 1024 * 1024
#: How long one read may take: a poll that hangs must not hold the set older than a poll or two.
READ_TIMEOUT_SECONDS = 2.0
#: How long a set may go without a newer one before the gateway says it is stale: the monitors
#: sign theirs anew every minute (``containment_signing.renew_seconds``), so five renewals missed.
STALE_SECONDS = 300.0
#: A reason of refusal is logged at most this often (with the count since): a writer forging values
#: without pause must not flood the gateway's log.
REFUSAL_LOG_SECONDS = 60.0


class QuarantineWatch:
    """The last quarantine set taken from the monitor, kept fresh by a daemon thread (module doc)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        keys: PublicKeys,
        gateway: str = "",
        poll_seconds: float = 1.0,
        timeout_seconds: float = READ_TIMEOUT_SECONDS,
        stale_seconds: float = STALE_SECONDS,
        start: bool = True,
    ):
        """``url``: the monitor's base URL; ``keys``: the monitors' public keys by id (a set signed
        by none of them is refused); ``gateway``: this gateway's name, sent with each read;
        ``start``: begin polling now (else on the first lookup)."""
        self.url = url.rstrip("/") + "/api/v1/quarantine"
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if gateway:
            self._headers[GATEWAY_HEADER] = gateway
        self.keys = keys
        self.gateway = gateway
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        self.stale_seconds = stale_seconds
        #: Swapped whole by the poller; a lookup reads this one attribute.
        self.current: QuarantineSet = EMPTY
        #: Epoch seconds of the last signed set read (newer or the same), None before the first.
        self.last_read_at: float | None = None
        #: ``time.monotonic()`` when a set last moved the watch forward, None before the first.
        self.moved_at: float | None = None
        #: Whether the last read failed (the set is then the last known one).
        self.failing = False
        #: Values refused, by reason (``signed.REASONS``), as the gateway's counter was told.
        self.refused: collections.Counter[str] = collections.Counter()
        self._count_refused = gateway_counter(
            "kvcanary_tap_quarantine_refused",
            "Values of kvcanary's quarantine set the tap refused (not signed by the monitors' keys, "
            "or older than the set it holds), by reason; the last set it took stays applied.",
            ("reason",),
        )
        self._refusals_said: dict[str, tuple[float, int]] = {}  # reason: (when said, count then)
        self._stale_said = False
        self._closed = False
        self._start_afresh()
        _WATCHES.add(self)
        _export_gauges()
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
        """Return the set as last taken: memory only, never the network. Starts this process's
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

    @property
    def stale(self) -> bool:
        """Whether the set held has not moved forward within ``stale_seconds``, or has expired
        (False before any set was taken: that is unreadable, not stale)."""
        if self.moved_at is None:
            return False
        late = time.monotonic() - self.moved_at > self.stale_seconds
        return late or self.current.expires <= time.time()

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
                self.check_stale()
            except Exception:  # the poller outlives anything; the set stays the last known
                log.exception("kvcanary tap: cannot read the quarantine")
            self._stop.wait(max(0.0, self.poll_seconds - (time.monotonic() - began)))

    def poll_once(self) -> bool:
        """Read the monitor's set once and take it; return False (and keep the last set) when the
        answer cannot be read or is refused."""
        try:
            body = self._read()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._note_failure(exc)
            return False
        if not self.take(body):
            return False
        if self.failing:
            self.failing = False
            log.warning("kvcanary tap: the quarantine is read from the monitor again")
        return True

    def take(self, body: bytes) -> bool:
        """Take a value read (an answer's body, a bucket's value) as the set when the monitors
        signed it and it is not older than the set held; return whether it was a signed set
        (newer, or the held one again). A refusal is counted, logged (``REFUSAL_LOG_SECONDS``)
        and keeps the last set."""
        try:
            found, moved = open_set(body, self.keys, self.current, time.time())
        except Refused as refused:
            self._refuse(refused)
            return False
        if moved:
            # Said before the set is taken: whoever reads the watch fresh again finds the line said.
            if self._stale_said:
                self._stale_said = False
                log.warning("kvcanary tap: the quarantine set moves forward again (%s)", describe(found))
            log_changes(self.current, found)
            self.current = found
            self.moved_at = time.monotonic()
        self.last_read_at = time.time()
        return True

    def check_stale(self) -> None:
        """Say once that the set held stopped moving forward or expired (it stays applied)."""
        if self.stale and not self._stale_said:
            self._stale_said = True
            held = self.current
            log.warning(
                "kvcanary tap: the quarantine set from %s is stale (%s, expires %s; no newer one for "
                "%.0f s); still applying it (%d deployment(s) quarantined): the monitors may be away, "
                "or its renewals withheld",
                self.url, describe(held), held.expires_at, time.monotonic() - (self.moved_at or 0.0),
                len(held.enforced),
            )  # fmt: skip

    def _refuse(self, refused: Refused) -> None:
        reason = refused.reason
        self.refused[reason] += 1
        self._count_refused(reason)
        said_at, count_then = self._refusals_said.get(reason, (-REFUSAL_LOG_SECONDS, 0))
        if time.monotonic() - said_at < REFUSAL_LOG_SECONDS:
            return
        self._refusals_said[reason] = (time.monotonic(), self.refused[reason])
        held = self.current
        log.warning(
            "kvcanary tap: refused a quarantine set from %s (%s; %d such since the last line): only "
            "a set the monitors signed, newer than the one held, is taken; keeping %s (%d deployment(s) "
            "quarantined)",
            self.url, refused, self.refused[reason] - count_then, describe(held), len(held.enforced),
        )  # fmt: skip

    def _read(self) -> bytes:
        """Return a 200 answer's body; raise OSError (no answer) or ValueError (another status, or
        a body over ``MAX_BODY_BYTES``)."""
        headers = dict(self._headers)
        if (held := self.current).revision >= 0:  # which set this gateway applies, for the monitor's count
            headers[QUARANTINE_HELD_HEADER] = f"{held.revision} {held.key_id}"
        request = urllib.request.Request(self.url, headers=headers, method="GET")
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


def log_changes(before: QuarantineSet, after: QuarantineSet) -> None:
    """Log each deployment that entered or left the set (once per change, not per poll)."""
    for mode, old, new in (("quarantined", before.enforced, after.enforced),
                           ("observed (not filtered)", before.observed, after.observed)):  # fmt: skip
        for key in new.keys() - old.keys():
            log.warning("kvcanary tap: deployment %s %s by kvcanary: %s", key, mode, new[key].describe())
        for key in old.keys() - new.keys():
            log.warning("kvcanary tap: deployment %s no longer %s", key, mode)


def _export_gauges() -> None:
    """The gateway's gauges: ``kvcanary_tap_quarantine_unreadable``, 1 while a watch of this process
    that is not closed cannot read the set, and ``kvcanary_tap_quarantine_stale``, 1 while one holds
    a set that stopped moving forward (either way the last set taken is applied), else 0."""
    gateway_gauge(
        "kvcanary_tap_quarantine_unreadable",
        "1 while kvcanary's quarantine set cannot be read from the monitor (or its NATS bucket): the "
        "gateway applies the last set it read.",
        lambda: float(any(w.failing and not w._closed for w in list(_WATCHES))),
    )
    gateway_gauge(
        "kvcanary_tap_quarantine_stale",
        "1 while kvcanary's quarantine set held has expired or no newer one came for a while: the "
        "gateway still applies it; the monitors may be away or their renewals withheld.",
        lambda: float(any(w.stale and not w._closed for w in list(_WATCHES))),
    )


#: Every watch of this process, for the fork hook (weakly: the hook keeps no watch alive).
_WATCHES: weakref.WeakSet[QuarantineWatch] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for watch in list(_WATCHES):
        watch._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
