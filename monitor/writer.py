"""One writer thread that records results in batches: one commit for many verdicts.

A transaction per probe run cost a commit (and an fsync) per run: at thousands of targets, the
largest share of the monitor's time. Runs hand their results to :class:`BatchWriter`; its thread
takes whatever has queued up (at most ``MAX_BATCH``), records it with
:meth:`Recorder.record_many` in one transaction, and resolves each run's future with its outcome.
Order is kept: one queue, one thread, and each (target, probe) hands in its results one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from datetime import datetime

from monitor.incidents import RecordOutcome
from monitor.recorder import Recorder
from monitor.spool import PendingResult
from monitor.storage.db import utcnow
from monitor.target_config import TargetConfig
from probes.base import ProbeResult

log = logging.getLogger("kvcanary.writer")

#: Results recorded in one transaction at most: big enough to amortise the commit, small enough
#: that one slow batch does not hold the others' verdicts back for long.
MAX_BATCH = 200

Waiting = tuple[PendingResult, "asyncio.Future[RecordOutcome | None]", asyncio.AbstractEventLoop]


class BatchWriter:
    """Records submitted results from one thread, many to a transaction."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self._queue: queue.SimpleQueue[Waiting | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvcanary-writer", daemon=True)
        self._thread.start()

    async def submit(
        self,
        target: TargetConfig,
        probe: str,
        result: ProbeResult,
        started_at: datetime,
        duration: float,
        node: str = "",
    ) -> RecordOutcome | None:
        """Record one result (batched with others); return its outcome, None when spooled or dropped."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RecordOutcome | None] = loop.create_future()
        item = PendingResult.of(target, probe, result, started_at, duration, utcnow(), node)
        self._queue.put((item, future, loop))
        return await future

    def close(self, timeout: float = 30.0) -> None:
        """Record what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(more)
            self._record(batch)

    def _record(self, batch: list[Waiting]) -> None:
        try:
            outcomes = self.recorder.record_many([item for item, _, _ in batch])
        except Exception:  # never lose the thread: say so, and answer every run
            log.exception("recording a batch of %d results failed", len(batch))
            outcomes = [None] * len(batch)
        for (_, future, loop), outcome in zip(batch, outcomes, strict=True):
            loop.call_soon_threadsafe(_settle, future, outcome)


def _settle(future: asyncio.Future[RecordOutcome | None], outcome: RecordOutcome | None) -> None:
    if not future.done():  # the run may have been cancelled while its result was being written
        future.set_result(outcome)
