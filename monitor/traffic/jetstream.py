"""Gateway traffic read from NATS JetStream (``traffic.source: jetstream``), judged exactly once.

Taps publish records on ``<subject_prefix>.<partition>`` (``kvcanary/tap/jetstream.py``), a
batch's records of one partition to a message, ``{"records": [...]}`` as the HTTP ingest takes them
(header ``Kvcanary-Records``: their count); the stream, its consumers and the ownership bucket are
made by ``stream_setup.py``, and each partition is consumed by one replica at a time (``partitions.py``).

The replica that holds a partition pulls up to ``BATCH_MESSAGES`` messages (waiting at most
``BATCH_WAIT_SECONDS``), decodes them into :class:`TrafficRecord` s, and judges them through
:class:`TrafficIngest` in this process. It acknowledges a batch only once its rows are stored and
its results recorded, so a replica that dies midway has its batch delivered again (after
``ack_wait_seconds``) to whichever replica holds the partition then.

Exactly once, by record id: judging a record writes ``(partition, record id)`` into
``traffic_judged`` in the same transaction as its rows (``storage/judged_rows.py``), and every
pulled batch first asks which of its ids are there; those (a redelivery after a death or a lost
acknowledgement, a tap's resend after the stream's duplicate window) are acknowledged without being
judged again. A record id is remembered twice the duplicate window. The alternative, a
last-judged stream sequence per partition, would lose records: a new owner judges new messages
while the dead owner's unacknowledged ones wait out ``ack_wait``, and a checkpoint past them would
skip them when they come back. A record that is not valid is acknowledged with its message and
counted as rejected (it can never become valid); the others of its message are judged. A batch
being judged when its consumer is cut (a hand-over outlasting ``STOP_WAIT_SECONDS``, a stop) is left
to finish storing and recording (``_land``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from pydantic import ValidationError

from monitor.config.settings import JetStreamConfig
from monitor.storage.judged_rows import judged_already
from monitor.traffic.ingest import TrafficIngest
from monitor.traffic.partitions import LEASE_SECONDS, STEP_SECONDS, Partitions
from monitor.traffic.schema import TrafficRecord, read_batch
from monitor.traffic.stream_setup import connect, durable_name, prepare, why

log = logging.getLogger("kvcanary.traffic")

#: Messages a pull takes, each a tap batch's share of a partition (up to 200 records): a pull's
#: records are judged and stored together, in one transaction, under their deployment's lock.
BATCH_MESSAGES = 20
BATCH_WAIT_SECONDS = 0.25
#: Seconds between tries while NATS or the database fails a batch (the last repeats).
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0)
#: How long a handed-over partition's batch in hand may take to finish.
STOP_WAIT_SECONDS = LEASE_SECONDS / 3
#: How long stopping waits for batches cut at a hand-over to be stored and recorded.
LANDING_WAIT_SECONDS = 10.0
#: What the tap writes beside each record (``kvcanary/tap/jetstream.py``: the same names).
GATEWAY_HEADER = "Kvcanary-Gateway"
DROPPED_HEADER = "Kvcanary-Dropped"
RECORDS_HEADER = "Kvcanary-Records"
_GATEWAY_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass
class Pulled:
    """One record of a message, decoded: the record, the id it is judged once by, and what rode
    with its message (``dropped`` on the message's first record only)."""

    record: TrafficRecord
    key: str
    gateway: str
    dropped: int


def decode(message: Msg) -> tuple[list[Pulled], int]:
    """Return the message's valid records (a tap batch's share, read as the HTTP ingest reads a
    body), and how many it carried that are not valid (they never will be)."""
    headers = message.headers or {}
    try:
        _, valid = read_batch(message.data)
    except ValidationError:  # the envelope itself: nothing in it can be read
        return [], max(1, _count(headers.get(RECORDS_HEADER, "")))
    records, rejected = valid.records, valid.refused
    gateway = headers.get(GATEWAY_HEADER, "")
    gateway = gateway if _GATEWAY_RE.fullmatch(gateway) else ""
    dropped = _count(headers.get(DROPPED_HEADER, ""))
    seq = message.metadata.sequence.stream
    pulled = [
        # A record without an id is judged once by its place in the stream (a redelivery keeps it).
        Pulled(record, record.id or f"#{seq}.{i}", gateway, dropped if i == 0 else 0)
        for i, record in enumerate(records)
    ]
    return pulled, rejected


def _count(text: str) -> int:
    return int(text) if text.isdigit() and len(text) < 12 else 0


class TrafficStream:
    """Consumes this replica's partitions of the traffic stream into ``ingest``; see the module doc."""

    def __init__(self, cfg: JetStreamConfig, ingest: TrafficIngest, replica: str, token: str | None):
        self.cfg = cfg
        self.ingest = ingest
        self.replica = replica
        self._token = token
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self.partitions: Partitions | None = None
        self._task: asyncio.Task[None] | None = None
        self._consumers: dict[int, tuple[asyncio.Event, asyncio.Task[None]]] = {}
        #: Batches being stored and recorded, which a cut consumer leaves to finish (``_land``).
        self._landing: set[asyncio.Task[None]] = set()
        #: Tries in a row that failed, per partition: the backoff, and one log line per outage.
        self._failures: dict[int, int] = {}
        #: Counts since start (``/healthz``): judged, redelivered records not judged again, rejected.
        self.judged = 0
        self.duplicates = 0
        self.rejected = 0
        #: Per partition held: the messages waiting behind its last pull, and how long the newest
        #: of that pull had waited in the stream (the lag metrics; 0 once a pull finds nothing).
        self._pending: dict[int, int] = {}
        self._lag: dict[int, float] = {}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Finish the batches in hand, release the partitions to the others, and disconnect."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.partitions is not None and self._client is not None and self._client.is_connected:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.partitions.leave(), 10)
        for n in list(self._consumers):
            await self._stop_partition(n)
        if self._landing:  # before the writer closes: what they store, they record
            _, pending = await asyncio.wait(set(self._landing), timeout=LANDING_WAIT_SECONDS)
            if pending:
                log.warning("traffic stream: %d batch(es) still being stored at stop; they come again",
                            len(pending))  # fmt: skip
        if self._client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._client.close(), 5)

    def report(self) -> dict[str, Any]:
        connected = self._client is not None and self._client.is_connected
        owned = sorted(self.partitions.claims) if self.partitions is not None else []
        live = len(self.partitions.live) if self.partitions is not None else 0
        return {"url": self.cfg.url, "stream": self.cfg.stream, "connected": connected, "replicas": live,
                "partitions": owned, "judged": self.judged, "duplicates": self.duplicates,
                "rejected": self.rejected, "pending_messages": sum(self._pending.values()),
                "lag_seconds": round(max(self._lag.values(), default=0.0), 3)}  # fmt: skip

    async def _run(self) -> None:
        self._client = await connect(self.cfg, self._token, keep_trying=True)
        self._js = self._client.jetstream(timeout=5)
        failures = 0
        kv: KeyValue | None = None
        while True:
            began = time.monotonic()
            try:
                if kv is None:
                    kv = await prepare(self._js, self.cfg)
                    self.partitions = Partitions(
                        kv, self.replica, self.cfg.partitions, self._start_partition, self._stop_partition
                    )
                await self.partitions.step()  # type: ignore[union-attr]  # set just above
                if failures:
                    log.info("traffic stream: sharing out the partitions again")
                failures = 0
            except Exception as exc:  # NATS away: keep the claims; they lapse if it stays away
                if failures == 0:
                    log.warning("traffic stream: cannot share out the partitions (%s); retrying", why(exc))
                failures += 1
            # A steady beat, however long a step took: the claims must be refreshed within a lease.
            await asyncio.sleep(max(0.0, STEP_SECONDS - (time.monotonic() - began)))

    def _start_partition(self, n: int) -> None:
        stopping = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._consume(n, stopping))
        self._consumers[n] = (stopping, task)
        log.info("traffic stream: consuming partition %d", n)

    async def _stop_partition(self, n: int) -> None:
        found = self._consumers.pop(n, None)
        if found is None:
            return
        stopping, task = found
        stopping.set()
        # A batch being judged finishes; one still going after STOP_WAIT_SECONDS (well within the
        # lease the other claims are refreshed in) is cut, and delivered again after ack_wait.
        _, pending = await asyncio.wait({task}, timeout=STOP_WAIT_SECONDS)
        for hung in pending:
            hung.cancel()
        self._pending.pop(n, None)
        self._lag.pop(n, None)
        log.info("traffic stream: partition %d handed over", n)

    async def _consume(self, n: int, stopping: asyncio.Event) -> None:
        """Pull and judge partition ``n`` until ``stopping``; a failure waits its backoff, never ends it."""
        while not stopping.is_set():
            try:
                await self._pull(n, stopping)
                return
            except Exception as exc:  # NATS or the database failed: the batch comes again
                failures = self._failures.get(n, 0)
                if failures == 0:
                    log.warning("traffic stream: partition %d: %s; retrying", n, why(exc))
                self._failures[n] = failures + 1
                await asyncio.sleep(BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)])

    async def _pull(self, n: int, stopping: asyncio.Event) -> None:
        assert self._js is not None  # partitions start only once connected
        sub = await self._js.pull_subscribe_bind(durable=durable_name(n), stream=self.cfg.stream)
        try:
            while not stopping.is_set():
                try:
                    messages = await sub.fetch(BATCH_MESSAGES, timeout=BATCH_WAIT_SECONDS)
                except TimeoutError:  # nothing came (nats-py raises its own and asyncio's)
                    self._pending[n], self._lag[n] = 0, 0.0
                    continue
                newest = messages[-1].metadata
                self._pending[n] = newest.num_pending
                self._lag[n] = max(0.0, time.time() - newest.timestamp.timestamp())
                try:
                    await self._handle(n, messages)
                except Exception:
                    for message in messages:  # at once to the next pull, not after ack_wait
                        with contextlib.suppress(Exception):
                            await message.nak()
                    raise
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _handle(self, n: int, messages: list[Msg]) -> None:
        """Judge a pulled batch's new records, store them with their marks, then acknowledge all."""
        pulled: list[Pulled] = []
        rejected = 0
        for i, message in enumerate(messages):
            if i:
                await asyncio.sleep(0)  # a message is up to 200 records: the loop's work between them
            valid, bad = decode(message)
            pulled += valid
            rejected += bad
        self.rejected += rejected
        if rejected:
            log.warning("traffic stream: partition %d: %d record(s) are not valid; dropped", n, rejected)
        seen = await asyncio.to_thread(self._judged_already, n, [p.key for p in pulled])
        fresh: dict[str, list[Pulled]] = {}
        for p in pulled:
            if p.key in seen:
                continue
            seen.add(p.key)  # the same record twice in one batch: judged once
            fresh.setdefault(p.gateway, []).append(p)
        judged = sum(len(group) for group in fresh.values())
        self.duplicates += len(pulled) - judged
        if fresh:
            await self._land(n, fresh)
        self.judged += judged
        for message in messages:
            await message.ack()
        assert self._client is not None  # pulled through it
        await self._client.flush()  # the acknowledgements are out before the next pull
        self._failures.pop(n, None)

    async def _land(self, n: int, fresh: dict[str, list[Pulled]]) -> None:
        """Judge, store and record ``fresh`` records, to the end even if this consumer is cut: their
        rows and marks commit in the database's thread whether its caller waits or not, and results
        not handed to the port then would be lost for good (the redelivery finds the marks)."""

        async def land() -> None:
            for gateway, group in fresh.items():
                marks = [(n, p.key) for p in group]
                dropped = sum(p.dropped for p in group)
                await self.ingest.ingest_marked(gateway, [p.record for p in group], marks, dropped)

        task = asyncio.get_running_loop().create_task(land())
        self._landing.add(task)
        task.add_done_callback(_landed(self._landing))
        await asyncio.shield(task)

    def _judged_already(self, n: int, keys: list[str]) -> set[str]:
        if not keys:
            return set()
        with self.ingest.session_factory() as session:
            return judged_already(session, n, keys)


def _landed(landing: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    """Return a done-callback that forgets a landed batch and takes its error, if any: a cut
    consumer no longer waits for it, and its records come again (not acknowledged)."""

    def done(task: asyncio.Task[None]) -> None:
        landing.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.debug("traffic stream: a batch failed to land (%s); it comes again", why(error))

    return done
