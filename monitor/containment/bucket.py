"""The quarantine set put in a JetStream KV bucket (``traffic.jetstream.quarantine_bucket``), where
the taps of gateways whose records go to NATS watch it (``kvcanary/tap/containment/bucket.py``)
instead of polling ``GET /api/v1/quarantine``: a change reaches every gateway replica when it is
put, and hundreds of gateway processes cost the monitors nothing.

Every replica runs the containment rules and, once it has read the pools the guards need, offers the
set it read after each round (``monitor/app.py``, every 0.5 s): when it differs from what this
replica put last (``generated_at`` aside), and every ``RECHECK_SECONDS`` anyway, it reads the
bucket's value and puts its own over one missing, unreadable or older. A set carries ``revision``,
the newest quarantine change row it was read at, which only grows: a replica that read the rows
before another never puts its older set over the newer one. The quarantines come from the rows all
replicas share; the guards from each replica's own reading of the pools, so at one revision a
replica puts its guards only when they changed, never in turn with another's. The bucket keeps the
last value and no TTL: a monitor restart, or every monitor gone, leaves the set as it was, which is
what a gateway must keep. A put that fails (NATS away) is tried again the next round; one line says
it, once per outage.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from kvcanary.monitor.config.settings import JetStreamConfig
from kvcanary.monitor.traffic.stream_setup import quarantine_bucket, why
from kvcanary.wire import QUARANTINE_KEY

log = logging.getLogger("kvcanary.containment")

#: How often a replica reads the bucket's value though its own set did not change: a value lost,
#: deleted or left older by a replica that stopped is put right within this.
RECHECK_SECONDS = 10.0


class QuarantineBucket:
    """Puts the quarantine set in the bucket when it changed (module doc). ``connection`` returns the
    replica's JetStream context while connected (``TrafficStream.connection``), else None."""

    def __init__(
        self,
        cfg: JetStreamConfig,
        connection: Callable[[], tuple[JetStreamContext, int] | None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.connection = connection
        self.clock = clock
        self._kv: KeyValue | None = None
        self._put: str | None = None  # what this replica put (or found there) last, generated_at aside
        self._checked = float("-inf")  # when the bucket's value was last read
        self._failing = False
        #: Puts made since start (``/healthz``).
        self.puts = 0

    async def publish(self, document: dict[str, Any]) -> bool:
        """Put ``document`` where the module doc says to; return whether the bucket holds a set
        at least as new (False: NATS could not be asked)."""
        content = _content(document)
        changed = content != self._put
        if not changed and self.clock() - self._checked < RECHECK_SECONDS:
            return True
        connected = self.connection()
        if connected is None:
            return self._failed("not connected to NATS")
        try:
            if self._kv is None:
                self._kv = await quarantine_bucket(connected[0], self.cfg)
            held = await _held(self._kv)
            self._checked = self.clock()
            if _should_put(held, document, content, changed):
                await self._kv.put(QUARANTINE_KEY, json.dumps(document).encode())
                self.puts += 1
        except Exception as exc:  # NATS away, the bucket deleted: bound again next round
            self._kv = None
            return self._failed(why(exc))
        self._put = content
        if self._failing:
            self._failing = False
            log.warning("quarantine set: put in the bucket %s again", self.cfg.quarantine_bucket)
        return True

    def _failed(self, reason: str) -> bool:
        if not self._failing:
            self._failing = True
            log.warning("quarantine set: cannot put it in the bucket %s (%s); the taps watching it keep "
                        "the last set; trying every round", self.cfg.quarantine_bucket, reason)  # fmt: skip
        return False


def _content(document: dict[str, Any]) -> str:
    """What two sets are compared by: everything but when each was made."""
    return json.dumps({k: v for k, v in document.items() if k != "generated_at"}, sort_keys=True)


async def _held(kv: KeyValue) -> dict[str, Any] | None:
    """The set the bucket holds, or None (no value, a deleted one, or one that is not a set)."""
    try:
        entry = await kv.get(QUARANTINE_KEY)
    except KeyNotFoundError:
        return None
    try:
        found = json.loads(entry.value or b"")
    except ValueError:
        return None
    return found if isinstance(found, dict) and isinstance(found.get("revision"), int) else None


def _should_put(held: dict[str, Any] | None, document: dict[str, Any], content: str, changed: bool) -> bool:
    """Whether to put ``document`` over what the bucket holds: a set missing or unreadable there, or
    older (a lower revision) is replaced; a newer one is left for this replica to catch up with; at
    the same revision (the same rows read), a set this replica saw change replaces another (its
    guards: each replica reads the pools itself), and an unchanged one is left, so that two
    replicas whose guards differ for a while do not put theirs in turn."""
    if held is None or held["revision"] < document["revision"]:
        return True
    if held["revision"] > document["revision"]:
        return False
    return changed and _content(held) != content
