"""The monitor's quarantine as a gateway holds it: the deployments a leak was found on,
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
    parse_quarantine,
)
from kvcanary.tap.gateway_metrics import gateway_gauge
from kvcanary.tap.http import _OPENER
from kvcanary.wire import api_base_key

log = logging.getLogger("kvcanary.tap")

#: The most of an answer read: a set of thousands of deployments fits many times over.
MAX_BODY_BYTES = 1024 * 1024
#: How long one read may take: a poll that hangs must not hold the set older than a poll or two.
READ_TIMEOUT_SECONDS = 2.0


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
        log_changes(self.current, found)
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


def log_changes(before: QuarantineSet, after: QuarantineSet) -> None:
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


#: Every watch of this process, for the fork hook (weakly: the hook keeps no watch alive).
_WATCHES: weakref.WeakSet[QuarantineWatch] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for watch in list(_WATCHES):
        watch._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
