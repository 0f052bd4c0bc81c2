"""The quarantine set put in a JetStream KV bucket (``traffic.jetstream.quarantine_bucket``), where
the taps of gateways whose records go to NATS watch it (``kvcanary/tap/quarantine_bucket.py``)
instead of polling ``GET /api/v1/quarantine``: a change reaches every gateway replica when it is
put, and hundreds of gateway processes cost the monitors nothing.

Every replica runs the containment rules and puts the set it reads after each round
(``monitor/app.py``, every 0.5 s), only when it differs from what this replica put last, leaving
``generated_at`` aside: all replicas read the same rows, so they put the same set, and a replica
that lags a round puts the newer set a round later. The bucket keeps the last value and no TTL: a
monitor restart, or every monitor gone, leaves the set as it was, which is what a gateway must keep.
A put that fails (NATS away) is tried again the next round; one line says it, once per outage.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from kvcanary.monitor.config.settings import JetStreamConfig
from kvcanary.monitor.traffic.stream_setup import quarantine_bucket, why
from kvcanary.wire import QUARANTINE_KEY

log = logging.getLogger("kvcanary.containment")


class QuarantineBucket:
    """Puts the quarantine set in the bucket when it changed (module doc). ``connection`` returns the
    replica's JetStream context while connected (``TrafficStream.connection``), else None."""

    def __init__(self, cfg: JetStreamConfig, connection: Callable[[], tuple[JetStreamContext, int] | None]):
        self.cfg = cfg
        self.connection = connection
        self._kv: KeyValue | None = None
        self._put: str | None = None  # what this replica put last, generated_at aside
        self._failing = False
        #: Puts made since start (``/healthz``).
        self.puts = 0

    async def publish(self, document: dict[str, Any]) -> bool:
        """Put ``document`` unless it is what was put last; return whether the bucket holds it."""
        content = json.dumps({k: v for k, v in document.items() if k != "generated_at"}, sort_keys=True)
        if content == self._put:
            return True
        connected = self.connection()
        if connected is None:
            return self._failed("not connected to NATS")
        try:
            if self._kv is None:
                self._kv = await quarantine_bucket(connected[0], self.cfg)
            await self._kv.put(QUARANTINE_KEY, json.dumps(document).encode())
        except Exception as exc:  # NATS away, the bucket deleted: bound again next round
            self._kv = None
            return self._failed(why(exc))
        self._put = content
        self.puts += 1
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
