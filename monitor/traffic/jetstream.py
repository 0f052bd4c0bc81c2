"""Gateway traffic read from NATS JetStream (``traffic.source: jetstream``), judged exactly once.

Taps publish a batch's records of one partition as one message (``kvcanary/tap/jetstream.py``); the
replica that holds a partition (``partitions.py``) pulls batches of messages, reads them as records
(``messages.py``) and hands them to the one traffic pipeline (:meth:`TrafficPipeline.take`), as the
HTTP ingest does. It acknowledges a batch only once its rows are stored and its results recorded, so
a replica that dies midway has its batch delivered again to whichever replica holds the partition
then.

Exactly once, by the tap's record id: the pipeline writes it into ``traffic_judged`` with the
record's rows, and ids found there are acknowledged without being judged again. A record that is not
valid, or that sits on a partition its ``api_base`` does not hash to, is acknowledged and counted
(rejected, misrouted), never judged. An empty pull is an idle partition, not a failure; one idle for
``CHECK_SECONDS`` asks whether its consumer is still there, and reports it ``missing`` if not.

Wire shape, why the record id and not a stream checkpoint, hand-over and recovery in full:
``docs/architecture.md``, "Through NATS JetStream".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from kvcanary.monitor.config.settings import JetStreamConfig
from kvcanary.monitor.traffic.messages import Pulled, by_partition, decode_all
from kvcanary.monitor.traffic.partitions import LEASE_SECONDS, STEP_SECONDS, Partitions
from kvcanary.monitor.traffic.pipeline import TrafficPipeline, read_off_loop
from kvcanary.monitor.traffic.stream_setup import connect, durable_name, prepare, why

log = logging.getLogger("kvcanary.traffic")

#: Messages a pull takes, each a tap batch's share of a partition (up to 200 records): a pull's
#: records are judged and stored together, in one transaction, under their deployment's lock.
#: Behind a backlog, more messages a pull is fewer statements a record (20: 6,300 records per
#: CPU-second of ``bench/jetstream.py``, 50: 6,500, on a loaded two-core machine).
BATCH_MESSAGES = 50
BATCH_WAIT_SECONDS = 0.25
#: Seconds between tries while NATS or the database fails a batch (the last repeats); never after
#: an empty pull, which is an idle partition.
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0)
#: A partition that pulled nothing this long asks whether its consumer is still there (a deleted
#: consumer or stream answers pulls as an idle one does): a deletion is found within it, and the
#: next step (``STEP_SECONDS``) makes the consumer again.
CHECK_SECONDS = 5.0
#: How long a handed-over partition's batch in hand may take to finish.
STOP_WAIT_SECONDS = LEASE_SECONDS / 3
#: How long stopping waits for batches cut at a hand-over to be stored and recorded.
LANDING_WAIT_SECONDS = 10.0
#: How long stopping waits for the sharing loop to end (a step's requests each wait 5 s at most).
RUN_STOP_WAIT_SECONDS = 10.0


class ConsumerGone(Exception):
    """A partition's durable consumer is not on the server (deleted, or its stream with it)."""


class TrafficStream:
    """Consumes this replica's partitions of the traffic stream into ``pipeline``; see the module doc."""

    def __init__(
        self,
        cfg: JetStreamConfig,
        pipeline: TrafficPipeline,
        replica: str,
        token: str | None,
        stop_wait_seconds: float = STOP_WAIT_SECONDS,
    ):
        self.cfg = cfg
        #: How long a handed-over partition's batch in hand may take to finish (``STOP_WAIT_SECONDS``).
        self.stop_wait_seconds = stop_wait_seconds
        self.pipeline = pipeline
        self.replica = replica
        self._token = token
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self.partitions: Partitions | None = None
        self._task: asyncio.Task[None] | None = None
        #: Set by ``stop()``: the sharing loop ends at its next check even where the cancellation
        #: that ``stop()`` sends it is lost (``_end``).
        self._stopping = False
        self._consumers: dict[int, tuple[asyncio.Event, asyncio.Task[None]]] = {}
        #: Batches being stored and recorded, which a cut consumer leaves to finish (``_land``).
        self._landing: set[asyncio.Task[int]] = set()
        #: Tries in a row that failed, per partition: the backoff, and one log line per outage.
        self._failures: dict[int, int] = {}
        #: Counts since start (``/healthz``): judged, redelivered records not judged again, rejected,
        #: and refused for their partition (``misrouted``).
        self.judged = 0
        self.duplicates = 0
        self.rejected = 0
        self.misrouted = 0
        #: Partitions held whose consumer was found gone, until the next step makes it again.
        self._missing: set[int] = set()
        #: Per partition held: the messages waiting behind its last pull, and how long the newest
        #: of that pull had waited in the stream (the lag metrics; 0 once a pull finds nothing).
        self._pending: dict[int, int] = {}
        self._lag: dict[int, float] = {}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Finish the batches in hand, release the partitions to the others, and disconnect."""
        self._stopping = True
        if self._task is not None:
            await _end(self._task, RUN_STOP_WAIT_SECONDS)
        if self.partitions is not None and self._client is not None and self._client.is_connected:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.partitions.leave(), 10)
        # All at once: each may wait STOP_WAIT_SECONDS for its batch in hand, and sixteen one after
        # another held a stop (and a test's two-replica teardown) past three minutes on a loaded host.
        await asyncio.gather(*(self._stop_partition(n) for n in list(self._consumers)))
        if self._landing:  # before the writer closes: what they store, they record
            _, pending = await asyncio.wait(set(self._landing), timeout=LANDING_WAIT_SECONDS)
            if pending:
                log.warning("traffic stream: %d batch(es) still being stored at stop; they come again",
                            len(pending))  # fmt: skip
        if self._client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._client.close(), 5)

    def report(self) -> dict[str, Any]:
        """Return what ``/healthz`` and ``/metrics`` say of the stream: ``partitions`` this replica
        holds, ``consuming`` those it pulls from now (connected, the consumer there), ``missing``
        those whose consumer or stream was found deleted and is not made again yet, of
        ``partition_count``; and the counts since start."""
        connected = self._connected()
        owned = sorted(self.partitions.claims) if self.partitions is not None else []
        live = len(self.partitions.live) if self.partitions is not None else 0
        missing = sorted(self._missing.intersection(owned))
        consuming = [n for n in owned if n not in self._missing] if connected else []
        return {"url": self.cfg.url, "stream": self.cfg.stream, "connected": connected, "replicas": live,
                "partition_count": self.cfg.partitions, "partitions": owned, "consuming": consuming,
                "missing": missing, "judged": self.judged, "duplicates": self.duplicates,
                "rejected": self.rejected, "misrouted": self.misrouted,
                "pending_messages": sum(self._pending.values()),
                "lag_seconds": round(max(self._lag.values(), default=0.0), 3),
                "bucket_anomalies": self.partitions.anomalies() if self.partitions else {}}  # fmt: skip

    async def _run(self) -> None:
        self._client = await connect(self.cfg, self._token, keep_trying=True)
        self._js = self._client.jetstream(timeout=5)
        failures = 0
        kv: KeyValue | None = None
        while not self._stopping:
            began = time.monotonic()
            try:
                if kv is None:
                    kv = await prepare(self._js, self.cfg)
                    self.partitions = Partitions(
                        kv, self.replica, self.cfg.partitions, self._start_partition, self._stop_partition,
                        max_replicas=self.cfg.max_replicas,
                    )  # fmt: skip
                await self.partitions.step()  # type: ignore[union-attr]  # set just above
                if failures:
                    log.info("traffic stream: sharing out the partitions again")
                failures = 0
            except Exception as exc:  # NATS away: keep the claims; they lapse if it stays away
                if failures == 0:
                    log.warning("traffic stream: cannot share out the partitions (%s); retrying", why(exc))
                failures += 1
            if self._stopping:  # stop() cancelled this loop, and a request in the step took the cancellation
                return
            if self._missing:
                await self._recreate()
            # A steady beat, however long a step took: the claims must be refreshed within a lease.
            await asyncio.sleep(max(0.0, STEP_SECONDS - (time.monotonic() - began)))

    async def _recreate(self) -> None:
        """Make the stream and its consumers again for the partitions that found theirs gone (as
        at start: what exists is kept); they stay reported missing until this succeeds."""
        assert self._js is not None  # a partition is consumed only once connected
        gone = set(self._missing)
        try:
            await prepare(self._js, self.cfg)
        except Exception as exc:  # tried again at the next step; the partitions stay reported
            log.warning("traffic stream: cannot make the stream's consumers again (%s); retrying", why(exc))
            return
        self._missing -= gone
        log.info("traffic stream: made the consumers of partition(s) %s again; pulling",
                    ", ".join(map(str, sorted(gone))))  # fmt: skip

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
        _, pending = await asyncio.wait({task}, timeout=self.stop_wait_seconds)
        for hung in pending:
            hung.cancel()
        self._pending.pop(n, None)
        self._lag.pop(n, None)
        self._missing.discard(n)
        log.info("traffic stream: partition %d handed over", n)

    async def _consume(self, n: int, stopping: asyncio.Event) -> None:
        """Pull and judge partition ``n`` until ``stopping``; a failure waits its backoff, a consumer
        gone waits until it is made again (``_run``); neither ends it."""
        while not stopping.is_set():
            try:
                await self._pull(n, stopping)
                return
            except ConsumerGone:
                log.warning("traffic stream: partition %d: its consumer %s is gone from stream %s "
                            "(deleted); making it again", n, durable_name(n), self.cfg.stream)  # fmt: skip
                self._missing.add(n)
                while n in self._missing and not stopping.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), 0.1)
            except Exception as exc:  # NATS or the database failed: the batch comes again
                failures = self._failures.get(n, 0)
                if failures == 0:
                    log.warning("traffic stream: partition %d: %s; retrying", n, why(exc))
                self._failures[n] = failures + 1
                await asyncio.sleep(BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)])

    async def _pull(self, n: int, stopping: asyncio.Event) -> None:
        assert self._js is not None  # partitions start only once connected
        sub = await self._js.pull_subscribe_bind(durable=durable_name(n), stream=self.cfg.stream)
        checked = time.monotonic()  # when the consumer last showed it is there
        try:
            while not stopping.is_set():
                try:
                    messages = await sub.fetch(BATCH_MESSAGES, timeout=BATCH_WAIT_SECONDS)
                except TimeoutError:  # nothing came (nats-py raises its own and asyncio's)
                    messages = []
                if not messages:  # an idle partition (nats-py 2.16 also answers an empty list)
                    self._pending[n], self._lag[n] = 0, 0.0
                    # NATS away is said by the connection (``connected``), not by each partition.
                    if time.monotonic() - checked >= CHECK_SECONDS and self._connected():
                        await self._check_consumer(n)
                        checked = time.monotonic()
                        self._end_failures(n)  # the server answered for the consumer: NATS is back
                    continue
                checked = time.monotonic()
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

    def connection(self) -> tuple[JetStreamContext, int] | None:
        """Return the JetStream context and the server's ``max_payload`` while connected (the HTTP
        ingest publishes posted records through this replica's connection), else None."""
        if self._js is None or self._client is None or not self._client.is_connected:
            return None
        return self._js, self._client.max_payload

    def _connected(self) -> bool:
        return self._client is not None and self._client.is_connected

    async def _check_consumer(self, n: int) -> None:
        """Raise ConsumerGone when partition ``n``'s consumer is not on the server."""
        assert self._js is not None  # partitions start only once connected
        try:
            await self._js.consumer_info(self.cfg.stream, durable_name(n))
        except NotFoundError:  # the consumer, or the stream and every consumer with it
            raise ConsumerGone(n) from None

    def _end_failures(self, n: int) -> None:
        """End partition ``n``'s run of failures: the next one is logged again, and waits least."""
        if self._failures.pop(n, 0):
            log.info("traffic stream: partition %d: pulling again", n)

    async def _handle(self, n: int, messages: list[Msg]) -> None:
        """Judge a pulled batch's new records, store them with their marks, then acknowledge all."""
        pulled: list[Pulled] = []
        rejected = 0
        # Read off the event loop, with the HTTP ingest's readers: a hostile message costs a reader
        # thread for a while, never the loop that answers /healthz and runs the canary.
        for valid, bad in await read_off_loop(decode_all, messages):
            pulled += valid
            rejected += bad
        self.rejected += rejected
        if rejected:
            log.warning("traffic stream: partition %d: %d record(s) are not valid; dropped", n, rejected)
        # A refused record's drop report goes with it: a copy on another partition must not count twice.
        pulled, refused = by_partition(pulled, n, self.cfg.partitions)
        if refused:
            self.misrouted += len(refused)
            log.warning("traffic stream: partition %d: %d record(s) of deployments that hash to other "
                        "partitions refused (a tap with other partitions than %d, or a record published "
                        "on several)",
                        n, len(refused), self.cfg.partitions)  # fmt: skip
        by_gateway: dict[str, list[Pulled]] = {}
        for p in pulled:
            by_gateway.setdefault(p.gateway, []).append(p)
        if by_gateway:
            judged = await self._land(by_gateway)
            self.judged += judged
            self.duplicates += len(pulled) - judged
        for message in messages:
            await message.ack()
        assert self._client is not None  # pulled through it
        await self._client.flush()  # the acknowledgements are out before the next pull
        self._end_failures(n)

    async def _land(self, by_gateway: dict[str, list[Pulled]]) -> int:
        """Take each gateway's records through the pipeline, to the end even if this consumer is
        cut: their rows and marks commit in the database's thread whether its caller waits or not,
        and results not handed to the port then would be lost for good (the redelivery finds the
        marks). Return how many were judged (the rest were judged already)."""

        async def land() -> int:
            judged = 0
            for gateway, group in by_gateway.items():
                answer = await self.pipeline.take(gateway, group)
                judged += len(group) - answer["duplicates"]
            return judged

        task = asyncio.get_running_loop().create_task(land())
        self._landing.add(task)
        task.add_done_callback(_landed(self._landing))
        return await asyncio.shield(task)


async def _end(task: asyncio.Task[None], timeout: float) -> None:
    """Cancel ``task`` and wait for it to end, ``timeout`` seconds at most; say where it waits if it
    does not.

    A cancellation can be lost: on Python 3.11, ``asyncio.wait_for`` (through which nats-py sends
    every request) returns the reply instead of raising when the cancellation comes in the loop
    iteration that brought the reply (CPython gh-86296, fixed in 3.12). The task then runs on, so it
    is cancelled again every second, and the sharing loop also ends at its next check of ``_stopping``.
    """
    deadline = time.monotonic() + timeout
    while not task.done() and (left := deadline - time.monotonic()) > 0:
        task.cancel()
        await asyncio.wait({task}, timeout=min(left, 1.0))
    if not task.done():
        frames = task.get_stack()
        where = f"{frames[-1].f_code.co_filename}:{frames[-1].f_lineno}" if frames else "an unknown place"
        log.warning("traffic stream: the partitions' loop did not end within %.0f s of stop (waiting at %s); "
                    "stopping without it", timeout, where)  # fmt: skip
    elif not task.cancelled() and (error := task.exception()) is not None:
        log.warning("traffic stream: the partitions' loop failed (%s)", why(error))


def _landed(landing: set[asyncio.Task[int]]) -> Callable[[asyncio.Task[int]], None]:
    """Return a done-callback that forgets a landed batch and takes its error, if any: a cut
    consumer no longer waits for it, and its records come again (not acknowledged)."""

    def done(task: asyncio.Task[int]) -> None:
        landing.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.debug("traffic stream: a batch failed to land (%s); it comes again", why(error))

    return done
