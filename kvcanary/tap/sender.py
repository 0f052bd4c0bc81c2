"""The tap's one background thread: exchanges in, summaries out to the monitor in batches.

Nothing here ever blocks or fails the gateway's request: :meth:`Sender.put` appends the exchange
as it is given (its texts by reference, their lengths taken in time proportional to their parts,
not their characters, so the queue is bounded in bytes as well as in entries) and returns. The
thread takes the texts' sizes and cuts them to what is fingerprinted (:meth:`Exchange.bounded`),
summarizes (so fingerprinting runs off the gateway's event loop), batches up to
``batch_records`` records or ``flush_seconds``, and posts. While the monitor is down, slow or
redirecting, summaries wait (at most ``max_pending`` in all, holding at most ``max_pending_bytes``
of texts and prints) and the batch is tried again after ``BACKOFF_SECONDS`` (customer requests
summarize meanwhile, never post: a down monitor costs one post a step, not one per request); past
either bound the oldest not being sent are dropped and counted. The count is exported on the
gateway side and reported to the monitor in the next batch it takes. Each batch carries an id, so
one the monitor judged but whose answer was lost is not judged twice when it is sent again.

How a batch leaves is its :class:`~kvcanary.tap.transport.Transport`'s (HTTP or NATS JetStream);
the queue's bounds, the backoff and the drop counts are the same for both.

The thread survives anything a try can raise (a gateway's odd payload, a monitor that answers
nonsense): the failure is logged and the batch waits for the next try.

A gateway that forks after building its tap (gunicorn ``--preload``, multiprocessing) gets a
working tap in each child (``os.register_at_fork``): the fork waits until no thread is inside the
tap's lock (each sender's lock is taken before the fork and let go after it, in the parent), so no
child inherits it held by a thread that does not exist there. The child's sender starts afresh:
a new lock, empty queues and counters (what was queued at the fork is the parent's to send, once),
its transport told (its ``after_fork_in_child()``, where it has one: the HTTP one forgets the
parent's encoded batch), and its own thread, started by its first :meth:`Sender.put`, as in any
process.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.http import HttpTransport
from kvcanary.tap.record import Exchange, printable_name, summarize
from kvcanary.tap.transport import Batch, Transport
from kvcanary.wire import MAX_DROPPED, MAX_RECORDS

log = logging.getLogger("kvcanary.tap")

#: Seconds between tries while the monitor does not take a batch (the last repeats).
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0, 10.0)
#: What a queued fingerprint costs in memory (a Python int and its place in a list), and a record
#: beside its prints: the byte bound counts these and the queued texts' characters.
PRINT_BYTES = 40
RECORD_BYTES = 1024


def _held_bytes(item: Exchange | dict[str, Any]) -> int:
    """Roughly what a queued exchange (its texts, whole until the tap's thread cuts them) or a
    record (its prints) holds in memory."""
    if isinstance(item, Exchange):
        return item.held_chars() + RECORD_BYTES
    prints = item["fingerprints"]
    return (len(prints["prompt"]) + len(prints["response"])) * PRINT_BYTES + RECORD_BYTES


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
        max_pending_bytes: int = 256 * 1024 * 1024,
        batch_records: int = 200,
        flush_seconds: float = 1.0,
        timeout_seconds: float = 5.0,
        on_drop: Callable[[int], None] | None = None,
        transport: Transport | None = None,
    ):
        """``transport``: how batches leave (default: an :class:`HttpTransport` to ``url``)."""
        self.transport = transport or HttpTransport(url, token, timeout_seconds)
        self.fingerprinter = fingerprinter
        self.gateway = printable_name(gateway)
        self.batch_records = min(batch_records, MAX_RECORDS)  # the monitor refuses a larger batch
        self.flush_seconds = flush_seconds
        self.timeout_seconds = timeout_seconds
        self._on_drop = on_drop
        self._max_pending = max_pending
        self._max_bytes = max_pending_bytes
        self._closed = False
        self._start_afresh()
        _SENDERS.add(self)

    def _start_afresh(self) -> None:
        """Set up the lock, empty queues and zero counters, and no thread yet (the first
        :meth:`put` starts it): a new sender's state, and a forked child's."""
        self._lock = threading.Condition()
        self._exchanges: collections.deque[Exchange] = collections.deque()
        self._records: collections.deque[dict[str, Any]] = collections.deque()
        self._queued_at: collections.deque[float] = collections.deque()  # beside _records
        self._sending = 0  # records at the head of _records in a post now: never dropped
        self._summarizing = 0  # 1 while the thread summarizes an exchange off the queues
        self._retry: tuple[str, int, int] | None = None  # the batch not yet taken: id, records, drops
        #: No post before this (monotonic) while backing off: new exchanges are summarized, not sent.
        self._next_try = 0.0
        self._bytes = 0  # what the queues hold (_held_bytes), under _lock
        #: Counters, read by tests and the gateway's metrics.
        self.sent = 0
        self.dropped = 0
        self.rejected = 0
        self._unreported_drops = 0
        #: Started by the first put(), in this process (``ident`` is None until then).
        self._thread = threading.Thread(target=self._loop, name="kvcanary-tap", daemon=True)

    def put(self, exchange: Exchange) -> None:
        """Queue one exchange as it is (its texts are cut on the tap's thread); past
        ``max_pending`` or ``max_pending_bytes``, drop the oldest waiting. Start the tap's thread
        if this process has none yet. Never raises."""
        size = _held_bytes(exchange)  # lengths only: no work in proportion to the texts
        with self._lock:
            if self._thread.ident is None and not self._closed:
                self._thread.start()
            while self.pending >= self._max_pending or (
                self.pending and self._bytes + size > self._max_bytes
            ):
                if not self._drop_oldest():  # everything waiting is in a post: this one goes
                    self._count_drop(1)
                    return
            self._exchanges.append(exchange)
            self._bytes += size
            self._lock.notify()

    def _drop_oldest(self) -> bool:
        """Drop the oldest record not in a post (else the oldest exchange); False: none can go."""
        held = self._retry[1] if self._retry is not None else 0  # a batch to send again
        if len(self._records) > held:
            self._bytes -= _held_bytes(self._records[held])
            del self._records[held]
            del self._queued_at[held]
        elif self._exchanges:
            self._bytes -= _held_bytes(self._exchanges.popleft())
        else:
            return False
        self._count_drop(1)
        return True

    @property
    def pending(self) -> int:
        """Exchanges and records in the tap: waiting, being summarized or being sent."""
        return len(self._exchanges) + self._summarizing + len(self._records)

    @property
    def pending_bytes(self) -> int:
        """Roughly what the waiting exchanges and records hold (bounded by ``max_pending_bytes``)."""
        return self._bytes

    @property
    def alive(self) -> bool:
        """Whether this process's tap thread runs (none does before the first :meth:`put`)."""
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then stop the thread."""
        with self._lock:
            self._closed = True
            self._lock.notify()
            started = self._thread.ident is not None
        if started:
            self._thread.join(timeout)
        self.transport.close()

    def _after_fork_in_child(self) -> None:
        """Start afresh in a forked child (the module doc): nothing of the parent's queue, lock or
        thread is the child's."""
        self._start_afresh()
        forked = getattr(self.transport, "after_fork_in_child", None)
        if forked is not None:
            forked()

    def _count_drop(self, n: int) -> None:
        with self._lock:
            self.dropped += n
            self._unreported_drops += n
        if self._on_drop is not None:
            self._on_drop(n)

    def _loop(self) -> None:
        failures = 0
        while True:
            with self._lock:
                while (wait := self._wait()) > 0:
                    self._lock.wait(wait)
                if self._closed and not self.pending:
                    return
            try:
                self._summarize_waiting()
                with self._lock:
                    due = self._post_due()
                posted = self._post_batch() if due else None
            except Exception:  # the thread must outlive anything one try raises
                log.exception("kvcanary tap: a batch failed; it waits for the next try")
                posted = False
            if posted is None:  # only summarized: the batch is not due yet
                continue
            if posted:
                failures, self._next_try = 0, 0.0
                continue
            if self._closed:
                return
            # Not a wait here: a customer's request (put) must not cut the backoff short, or a
            # monitor that is down gets a post per request (and the gateway pays for each).
            self._next_try = time.monotonic() + BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
            failures += 1

    def _post_due(self) -> bool:
        """Whether a batch is to be posted now: not while backing off (unless closing), and then a
        full batch, one whose oldest record has waited ``flush_seconds``, or anything when closing."""
        if not self._records:
            return False
        if self._closed:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        return len(self._records) >= self.batch_records or now - self._queued_at[0] >= self.flush_seconds

    def _wait(self) -> float:
        """Seconds to wait before there is work (0: now): exchanges to summarize, or a batch due."""
        if self._exchanges or self._closed:
            return 0.0
        if not self._records:
            return self.flush_seconds
        now = time.monotonic()
        if now < self._next_try:
            return self._next_try - now
        if len(self._records) >= self.batch_records:
            return 0.0
        return max(0.0, self.flush_seconds - (now - self._queued_at[0]))

    def _summarize_waiting(self) -> None:
        """Summarize the waiting exchanges one by one; each stays counted in ``pending`` and
        ``pending_bytes`` while it is summarized (its texts are still held), never dropped then."""
        while True:
            with self._lock:
                if not self._exchanges:
                    return
                exchange = self._exchanges.popleft()
                self._summarizing = 1
            try:
                record = summarize(exchange, self.fingerprinter)
            except Exception:  # a gateway's odd payload costs its record, never the thread
                log.exception("kvcanary tap: cannot summarize an exchange; dropped")
                with self._lock:
                    self._summarizing = 0
                    self._bytes -= _held_bytes(exchange)
                self._count_drop(1)
                continue
            with self._lock:
                self._summarizing = 0
                self._records.append(record)
                self._queued_at.append(time.monotonic())
                self._bytes += _held_bytes(record) - _held_bytes(exchange)

    def _post_batch(self) -> bool:
        """Send the oldest records; return False when not all of them were taken (the rest stay)."""
        with self._lock:
            if self._retry is None:  # a retry sends the same records under the same id
                self._retry = (
                    uuid.uuid4().hex,
                    min(self.batch_records, len(self._records)),
                    min(self._unreported_drops, MAX_DROPPED),  # the rest ride with the next batches
                )
            batch_id, self._sending, reported = self._retry
            records = [self._records[i] for i in range(self._sending)]
        try:
            taken, refused = self.transport.send(Batch(batch_id, self.gateway, reported, records))
        finally:
            with self._lock:
                self._sending = 0
        if not taken:
            return False
        taken = min(taken, len(records))
        with self._lock:
            # Taken in part (a publish after some acknowledged ones failed): the rest go again as
            # a new batch; the drop report rode with what was taken (a transport takes nothing
            # when the part that carried it failed).
            self._retry = None
            self._unreported_drops -= reported
            for _ in range(taken):
                self._bytes -= _held_bytes(self._records.popleft())
                self._queued_at.popleft()
            self.sent += taken - refused
            self.rejected += refused
        if refused:
            self._count_drop(refused)
        return taken == len(records)


#: Every sender of this process, for the fork hooks (weakly: a hook keeps no sender alive).
_SENDERS: weakref.WeakSet[Sender] = weakref.WeakSet()
#: The senders whose locks the fork in progress holds, taken by ``_before_fork``.
_HELD: list[Sender] = []


def _before_fork() -> None:
    """Take every sender's lock, so that none is held mid-operation when the process is copied."""
    _HELD[:] = list(_SENDERS)
    for sender in _HELD:
        sender._lock.acquire()


def _after_fork_in_parent() -> None:
    for sender in _HELD:
        sender._lock.release()
    _HELD.clear()


def _after_fork_in_child() -> None:
    for sender in _HELD:
        sender._after_fork_in_child()
    _HELD.clear()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
