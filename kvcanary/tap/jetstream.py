"""The tap's JetStream sink: records published to NATS JetStream, and kept until acknowledged.

Chosen by ``KVCANARY_TAP_URL=nats://host:4222`` (imported only then: the tap needs nothing beyond
the standard library otherwise, and ``nats-py`` here). A record goes to ``<prefix>.<partition>``
(``kvcanary.traffic.7``), the partition a stable hash of the record's ``api_base`` (normalized as the
monitor routes it) modulo ``KVCANARY_TAP_PARTITIONS``, so one deployment's records are always in one
partition, the unit a monitor replica owns. A batch's records of one partition travel as one
message, ``{"records": [...]}`` as the HTTP ingest takes them (at most ``MESSAGE_BYTES``, or the
server's ``max_payload`` where that is less; more messages past it), with the header
``Kvcanary-Records`` giving their count: per message the client, the server and the monitor do
their work once for a batch, not once for each record. A record larger alone than the server's
``max_payload`` can never be published: it is dropped and counted, not waited on. Its
``Nats-Msg-Id`` is the batch's id, partition and part: JetStream drops a resend of the same batch
within the stream's duplicate window (a publish whose acknowledgement was lost), and the monitor
drops any record it judged already by the record's own id.

A record leaves the tap's queue only once JetStream's PubAck for its message came back; from the
first record whose message did not come back on, the batch waits for the next try (the Sender's
backoff; records of later messages that were taken come again, and the monitor judges them once
by their ids, the tap's own where the gateway gave none). The drop report rides with the first
message published; a batch that publishes none (every record too large) leaves it to the next.
Where NATS cannot be reached, or no stream takes the subject (the monitor creates it, one subject
per partition: a tap with more partitions than the monitor is refused for the rest), the tap logs
one line and the records wait, bounded by the Sender's queue. Publishing runs on the Sender's
thread; the NATS client's own I/O runs on one more daemon thread with an event loop of its own, so
nothing of it touches the gateway's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from kvcanary import wire
from kvcanary.tap.transport import Batch

# The wire's names and rules, shared with the monitor (re-exported: callers import them from here).
from kvcanary.wire import DROPPED_HEADER as DROPPED_HEADER
from kvcanary.wire import GATEWAY_HEADER as GATEWAY_HEADER
from kvcanary.wire import HEADER_BYTES as HEADER_BYTES
from kvcanary.wire import MESSAGE_BYTES as MESSAGE_BYTES
from kvcanary.wire import PARTITIONS as PARTITIONS
from kvcanary.wire import RECORDS_HEADER as RECORDS_HEADER
from kvcanary.wire import SUBJECT_PREFIX as SUBJECT_PREFIX
from kvcanary.wire import VERSION_HEADER as VERSION_HEADER
from kvcanary.wire import Message, message_limit, publishable
from kvcanary.wire import partition_of as partition_of

log = logging.getLogger("kvcanary.tap")

#: Seconds a connection attempt may take; a dead NATS costs one such wait per backoff step.
CONNECT_TIMEOUT_SECONDS = 2


class JetStreamTransport:
    """Publishes batches to JetStream (see the module doc); a :class:`~kvcanary.tap.transport.Transport`."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        partitions: int = PARTITIONS,
        subject_prefix: str = SUBJECT_PREFIX,
        timeout_seconds: float = 5.0,
        user: str | None = None,
    ):
        """``token``: NATS's auth token, or ``user``'s password where a user is given (a server's
        permissions are per user: ``docs/nats-permissions.conf``)."""
        self.url = url
        self._token = token
        self._user = user
        self.partitions = partitions
        self.subject_prefix = subject_prefix
        self.timeout_seconds = timeout_seconds
        self._client: Client | None = None
        self._last_error: BaseException | None = None  # what the client's callback last saw
        self._failing = False  # an outage is logged once, when it begins
        # Drops reported by batches that had no message to carry the report (every record too
        # large): the Sender counts them reported, so they ride with the next message published.
        self._report_carried = 0
        self._start_loop()
        # Connect now, not at the first record: a NATS that is not there is said at the gateway's start.
        asyncio.run_coroutine_threadsafe(self._connected(), self._loop)

    def _start_loop(self) -> None:
        """Start the client's own event loop in a daemon thread (the tap's thread only waits on it)."""
        self._connecting = asyncio.Lock()  # the first send may meet the connection begun at start
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcanary-tap-nats", daemon=True)
        self._thread.start()

    def after_fork_in_child(self) -> None:
        """Start afresh in a forked child (``kvcanary.tap.sender``'s fork handling): the parent's loop
        thread is not here and its connection's socket is the parent's, so neither is touched (not
        closed: that would cut the parent's); a loop of the child's own connects at its first send.
        A drop report the parent carried is the parent's to send."""
        self._client = None
        self._last_error = None
        self._failing = False
        self._report_carried = 0
        self._start_loop()

    def send(self, batch: Batch) -> tuple[int, int]:
        """Publish the batch's messages; return (records acknowledged from the head, how many of
        those were refused for ever: a record alone larger than the server's ``max_payload``).
        JetStream refuses no other record for what it holds; the monitor refuses malformed ones."""
        wait = self.timeout_seconds + 2 * CONNECT_TIMEOUT_SECONDS + 1
        result = self._run(self._send(batch), wait)
        return (0, 0) if result is None else result

    def close(self) -> None:
        """End the connection and the client's loop; a second call does nothing (a gateway may
        close its tap from a shutdown hook and again at exit)."""
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        self._run(self._shutdown(), 3.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(2.0)
        if not self._thread.is_alive():  # its selector and wake-up sockets: a gateway's files
            self._loop.close()

    async def _shutdown(self) -> None:
        """Close the connection and end every task of the client's loop (a connection still being
        made included), so none is left half-begun when the loop stops."""
        await self._disconnect()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self._disconnect()

    def _run(self, coroutine: Coroutine[Any, Any, Any], timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            self._outage(TimeoutError(f"no answer within {timeout:.0f}s"))
            return None
        except FutureCancelled:  # close() ended a send in flight: its records wait, untaken
            return None

    async def _send(self, batch: Batch) -> tuple[int, int]:
        client = await self._connected()
        if client is None:
            return 0, 0
        js = client.jetstream(timeout=self.timeout_seconds)
        limit = client.max_payload
        messages = self.messages_of(batch, message_limit(limit))
        report = batch.dropped + self._report_carried
        # A record alone over the server's max_payload, its headers counted as the server counts
        # them, can never be published (the server would close the connection): refused here. The
        # drop report rides with the first message published.
        sendable, never = publishable(messages, limit, report)
        too_large = [(m.first, int(m.headers[RECORDS_HEADER])) for m in never]
        # Published at once, one connection, in order (the stream keeps it; a message redelivered
        # after a replica's death comes back after ack_wait, behind later ones).
        acks = await asyncio.gather(
            *(js.publish(subject, payload, headers=headers) for subject, payload, headers, _ in sendable),
            return_exceptions=True,
        )
        taken = len(batch.records)
        for (subject, _, headers, first), ack in zip(sendable, acks, strict=True):
            if isinstance(ack, BaseException):
                if self._refused(ack, subject):
                    await self._disconnect()
                # The drop report not delivered: nothing leaves, so that the Sender keeps it.
                taken = 0 if DROPPED_HEADER in headers else min(taken, first)
        if not sendable:
            self._report_carried = report
        elif taken:  # the message that carried the report was acknowledged
            self._report_carried = 0
        refused = sum(count for first, count in too_large if first < taken)
        if refused:
            log.error("kvcanary tap: %d record(s) larger than NATS's max_payload (%d bytes) dropped",
                      refused, limit)  # fmt: skip
        if taken == len(batch.records) and self._failing:
            self._failing = False
            log.warning("kvcanary tap: JetStream at %s takes records again", self.url)
        return taken, refused

    def messages_of(self, batch: Batch, limit: int = MESSAGE_BYTES) -> list[Message]:
        """:func:`messages_of` under this transport's partitions and subject prefix."""
        return messages_of(batch, self.partitions, self.subject_prefix, limit)

    async def _connected(self) -> Client | None:
        async with self._connecting:
            if self._client is not None and self._client.is_connected:
                return self._client
            return await self._connect()

    async def _connect(self) -> Client | None:
        await self._disconnect()

        async def note(error: Exception) -> None:  # the client's own logging prints tracebacks
            self._last_error = error

        try:
            # No reconnecting inside the client: the Sender's backoff paces the tries, and a
            # fresh connection per outage leaves no publish buffered in a dead one.
            credentials: dict[str, Any] = (
                {"user": self._user, "password": self._token or ""} if self._user else {"token": self._token}
            )
            self._client = await nats.connect(
                self.url, **credentials, allow_reconnect=False, max_reconnect_attempts=1,
                reconnect_time_wait=0.1, connect_timeout=CONNECT_TIMEOUT_SECONDS, error_cb=note,
                name="kvcanary-tap",
            )  # fmt: skip
        except Exception as exc:
            self._outage(self._last_error or exc)
            return None
        return self._client

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None and not client.is_closed:
            with contextlib.suppress(Exception):  # a broken connection: nothing left to save
                await asyncio.wait_for(client.close(), 1.0)

    def _refused(self, error: BaseException, subject: str) -> bool:
        """A publish on ``subject`` was not acknowledged: say why, once per outage; return whether
        the connection is broken (to be dropped)."""
        if isinstance(error, nats.js.errors.NoStreamResponseError | nats.errors.NoRespondersError):
            self._outage(
                error,
                f"no JetStream stream takes {subject} (the monitor creates one subject per partition "
                f"of its traffic.jetstream.partitions; KVCANARY_TAP_PARTITIONS is {self.partitions})",
            )
            return False
        if isinstance(error, nats.js.errors.APIError):
            self._outage(error, f"JetStream refused a record ({error.description})")
            return False
        self._outage(error)
        return True

    def _outage(self, error: BaseException, what: str = "") -> None:
        if not self._failing:
            self._failing = True
            why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            log.warning(
                "kvcanary tap: %s at %s (%s); records wait", what or "cannot reach NATS", self.url, why
            )


def subject_of(record: dict[str, Any], partitions: int, prefix: str = SUBJECT_PREFIX) -> str:
    """Return the subject ``record`` is published on: ``<prefix>.<partition of its api_base>``."""
    return wire.subject_of(str(record.get("api_base", "")), partitions, prefix)


def messages_of(
    batch: Batch, partitions: int, prefix: str = SUBJECT_PREFIX, limit: int = MESSAGE_BYTES
) -> list[Message]:
    """Return the batch as messages (``kvcanary.wire.messages_of``: the protocol's framing, which
    a tap in another language makes byte for byte, ``tests/fixtures/wire/framing.json``)."""
    return wire.messages_of(batch.id, batch.gateway, batch.records, partitions, prefix, limit)
