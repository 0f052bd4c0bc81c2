"""One writer thread that records results in batches: one commit for many verdicts.

A transaction per probe run cost a commit (and an fsync) per run: about 2.5 ms of CPU for one pass
on SQLite against 0.4 ms each in a batch of 200, at thousands of targets the largest share of the
monitor's time. Runs hand their results to :class:`BatchWriter`; its thread takes what has queued
up, waiting up to ``LINGER_SECONDS`` for more while everything so far passed (as PostgreSQL's
``commit_delay`` does), records the batch with :meth:`Recorder.record_many` in one transaction,
and resolves each run's future with its outcome. A leak, mismatch or error is written at once with
whatever waits beside it: bad news is never held back for a bigger batch. Order is kept: one
queue, one thread, and each (target, probe) hands in its results one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from typing import Any

from kvcanary.monitor.incidents import RecordOutcome
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.probes.base import Verdict

log = logging.getLogger("kvcanary.writer")

#: Results recorded in one transaction at most: big enough to amortise the commit, small enough
#: that one slow batch does not hold the others' verdicts back for long.
MAX_BATCH = 200
#: How long a batch of passes waits for company. Evenly spread runs arrive one at a time: without
#: a wait every commit would hold one result.
LINGER_SECONDS = 0.1

#: A queued result, and the future and loop of the run awaiting it (None for :meth:`BatchWriter.enqueue`).
Waiting = tuple[
    PendingResult, "asyncio.Future[RecordOutcome | None] | None", asyncio.AbstractEventLoop | None
]


class BatchWriter:
    """Records submitted results from one thread, many to a transaction (a ``ResultWriter``)."""

    def __init__(self, recorder: Recorder, linger_seconds: float = LINGER_SECONDS):
        self.recorder = recorder
        #: How long passes wait for company (``LINGER_SECONDS``); a test that needs them to wait
        #: longer says so here rather than patching the constant.
        self.linger_seconds = linger_seconds
        self._queue: queue.SimpleQueue[Waiting | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvcanary-writer", daemon=True)
        self._thread.start()

    async def submit(self, item: PendingResult) -> RecordOutcome | None:
        """Record one result (batched with others); return its outcome, None when spooled or dropped."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RecordOutcome | None] = loop.create_future()
        self._queue.put((item, future, loop))
        return await future

    def enqueue(self, item: PendingResult) -> None:
        """Queue one result without waiting for it (a run being cancelled cannot await its record)."""
        self._queue.put((item, None, None))

    def load_state(self, target: str, kind: str, node: str) -> dict[str, Any] | None:
        """Return the state a probe stored for (target, kind, node): :meth:`Recorder.load_state`."""
        return self.recorder.load_state(target, kind, node)

    def close(self, timeout: float = 30.0) -> int:
        """Record what is queued, then stop the thread; return how many results were spooled instead.

        A database that hangs (no error, no answer) holds the thread past ``timeout``: what is still
        queued then goes to the spool, to be replayed at the next start, rather than die with the process.
        """
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return 0
        spooled = 0
        while True:
            try:
                waiting = self._queue.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                self.recorder.spool.append(waiting[0])
                spooled += 1
        log.critical(
            "the database did not answer within %.0fs: %d queued result(s) spooled", timeout, spooled
        )
        return spooled

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stop = self._gather(first)
            self._record(batch)
            if stop:
                return

    def _gather(self, first: Waiting) -> tuple[list[Waiting], bool]:
        """Return a batch starting with ``first``, and whether close() was asked meanwhile."""
        batch = [first]
        deadline = time.monotonic() + self.linger_seconds
        all_passed = first[0].result.verdict is Verdict.PASS
        while len(batch) < MAX_BATCH:
            wait = deadline - time.monotonic() if all_passed else 0.0
            try:
                more = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                return batch, True
            batch.append(more)
            all_passed = all_passed and more[0].result.verdict is Verdict.PASS
        return batch, False

    def _record(self, batch: list[Waiting]) -> None:
        items = [item for item, _, _ in batch]
        try:
            outcomes = self.recorder.record_many(items)
        except Exception:  # never lose the thread nor the results (a duplicate beats a loss): spool them
            log.exception("recording a batch of %d results failed: spooling them", len(batch))
            for item in items:
                self.recorder.spool.append(item)
            outcomes = [None] * len(batch)
        for (_, future, loop), outcome in zip(batch, outcomes, strict=True):
            if future is None or loop is None:  # queued by enqueue(): nobody waits
                continue
            with contextlib.suppress(RuntimeError):  # the run's loop has closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, outcome)


def _settle(future: asyncio.Future[RecordOutcome | None], outcome: RecordOutcome | None) -> None:
    if not future.done():  # the run may have been cancelled while its result was being written
        future.set_result(outcome)
