"""The tap's one background thread: exchanges in, summaries out to the monitor in batches.

Nothing here ever blocks or fails the gateway's request: :meth:`Sender.put` appends to a bounded
queue and returns. The thread summarizes (so fingerprinting runs off the gateway's event loop),
batches up to ``batch_records`` records or ``flush_seconds``, and posts. While the monitor is down
or slow, summaries wait (at most ``max_pending``); beyond that the oldest are dropped and counted.
The count is exported on the gateway side and reported to the monitor in the next batch it takes.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize

log = logging.getLogger("kvcanary.tap")

#: Seconds between tries while the monitor does not take a batch (doubling up to the last).
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0, 10.0)


class Sender:
    """Summarizes and posts exchanges from one daemon thread; see the module doc."""

    def __init__(
        self,
        url: str,
        token: str,
        fingerprinter: Fingerprinter,
        *,
        gateway: str = "",
        max_pending: int = 10_000,
        batch_records: int = 200,
        flush_seconds: float = 1.0,
        timeout_seconds: float = 5.0,
        on_drop: Callable[[int], None] | None = None,
    ):
        self.url = url.rstrip("/") + "/api/v1/traffic"
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._fingerprinter = fingerprinter
        self.gateway = gateway
        self.batch_records = batch_records
        self.flush_seconds = flush_seconds
        self.timeout_seconds = timeout_seconds
        self._on_drop = on_drop
        self._exchanges: collections.deque[Exchange] = collections.deque()
        self._records: collections.deque[dict[str, Any]] = collections.deque()
        self._max_pending = max_pending
        self._wake = threading.Condition()
        self._closed = False
        #: Counters, read by tests and the gateway's metrics.
        self.sent = 0
        self.dropped = 0
        self.rejected = 0
        self._unreported_drops = 0
        self._thread = threading.Thread(target=self._loop, name="kvcanary-tap", daemon=True)
        self._thread.start()

    def put(self, exchange: Exchange) -> None:
        """Queue one exchange; drop the oldest waiting when full. Never raises, never blocks long."""
        with self._wake:
            if len(self._exchanges) + len(self._records) >= self._max_pending:
                if self._exchanges:
                    self._exchanges.popleft()
                else:
                    self._records.popleft()
                self._count_drop(1)
            self._exchanges.append(exchange)
            self._wake.notify()

    @property
    def pending(self) -> int:
        return len(self._exchanges) + len(self._records)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def _count_drop(self, n: int) -> None:
        self.dropped += n
        self._unreported_drops += n
        if self._on_drop is not None:
            self._on_drop(n)

    def _loop(self) -> None:
        failures = 0
        while True:
            with self._wake:
                if not self._exchanges and not self._records and not self._closed:
                    self._wake.wait(self.flush_seconds)
                if self._closed and not self._exchanges and not self._records:
                    return
            self._summarize_waiting()
            if not self._records or (len(self._records) < self.batch_records and not self._ripe()):
                continue
            if self._post_batch():
                failures = 0
                continue
            if self._closed:
                return
            time.sleep(BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)])
            failures += 1

    def _ripe(self) -> bool:
        """Whether the oldest waiting record has waited a flush interval (or the tap is closing)."""
        oldest = self._records[0].get("_queued", 0.0)
        return self._closed or time.monotonic() - oldest >= self.flush_seconds

    def _summarize_waiting(self) -> None:
        while True:
            with self._wake:
                if not self._exchanges:
                    return
                exchange = self._exchanges.popleft()
            try:
                record = summarize(exchange, self._fingerprinter)
            except Exception:  # a gateway's odd payload costs its record, never the thread
                log.exception("kvcanary tap: cannot summarize an exchange; dropped")
                self._count_drop(1)
                continue
            record["_queued"] = time.monotonic()
            with self._wake:
                self._records.append(record)

    def _post_batch(self) -> bool:
        """Post the oldest records; return False when the monitor did not take them (they stay)."""
        with self._wake:
            batch = [self._records[i] for i in range(min(self.batch_records, len(self._records)))]
        reported = self._unreported_drops
        body = {
            "gateway": self.gateway,
            "dropped": reported,
            "records": [{k: v for k, v in r.items() if k != "_queued"} for r in batch],
        }
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers=self._headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_seconds) as answer:
                answer.read()
        except urllib.error.HTTPError as exc:
            if exc.code >= 500 or exc.code in (401, 403, 429):
                log.warning("kvcanary tap: the monitor answered %s; records wait", exc.code)
                return False
            # A batch the monitor refuses as malformed would be refused forever: count it, go on.
            log.error(
                "kvcanary tap: the monitor refused a batch (%s): %d records dropped", exc.code, len(batch)
            )
            self.rejected += len(batch)
            self._count_drop(len(batch))
        except (OSError, ValueError) as exc:
            log.warning("kvcanary tap: cannot reach the monitor (%s); records wait", exc)
            return False
        else:
            self.sent += len(batch)
        taken = {id(r) for r in batch}
        with self._wake:
            self._unreported_drops -= reported
            while self._records and id(self._records[0]) in taken:
                self._records.popleft()
        return True
