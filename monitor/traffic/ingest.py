"""``POST /api/v1/traffic`` behind the router: a batch's valid records into the one traffic pipeline.

Where they go depends on ``traffic.source``:

- ``jetstream``: they are published to the stream, as the tap's JetStream sink publishes them
  (subjects, ``Nats-Msg-Id`` and headers, the protocol's version among them, by
  ``kvcanary.wire.messages_of``, the drop report on the first message), and the answer comes once
  JetStream acknowledged every message: ``accepted`` counts the records taken to be judged by
  whichever replica holds their partition. Posts to any replica are then judged once, in one
  fingerprint window per deployment.
  A publish that fails (NATS away, the stream full) is a 503: the tap keeps the batch and sends it
  again, the stream drops a message it holds already (its duplicate window) and the pipeline a
  record it judged already (its id).
- ``http``: they are taken here (:meth:`TrafficPipeline.take`): judged once by record id, stored,
  recorded. With more than one live replica (``Membership.live``) there is no single place to judge
  a deployment's records in, so the post is refused with a 503 naming ``traffic.source: jetstream``
  (the tap keeps its records), and logged at most once a minute.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcanary.monitor.config.settings import JetStreamConfig
from kvcanary.monitor.runs.replicas import Membership
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.pipeline import TrafficPipeline, arrivals, read_off_loop
from kvcanary.monitor.traffic.schema import TrafficBatch
from kvcanary.wire import DROPPED_HEADER, Message, message_limit, messages_of

if TYPE_CHECKING:  # nats-py is imported only where the stream is used
    from nats.js import JetStreamContext

log = logging.getLogger("kvcanary.traffic")

#: Seconds between two log lines about posts refused for want of the stream.
REFUSAL_LOG_SECONDS = 60.0
#: The answer's keys, each a count of the batch's records.
ANSWER_KEYS = ("accepted", "unmatched", "own", "flagged", "duplicates")


class NotTakenHere(Exception):
    """This replica cannot take a posted batch now (``str()`` says why): answered 503, so the tap
    keeps the records and sends them again."""


class HttpIngest:
    """Takes a posted batch's valid records: into the pipeline here, or onto the stream."""

    def __init__(
        self,
        pipeline: TrafficPipeline,
        membership: Membership | None = None,
        publisher: StreamPublisher | None = None,
    ):
        """``membership``: the replicas (None: this one alone); ``publisher``: the stream's, where
        ``traffic.source`` is ``jetstream``."""
        self.pipeline = pipeline
        self.membership = membership
        self.publisher = publisher
        self._refusal_logged_at = -REFUSAL_LOG_SECONDS

    @property
    def judge(self) -> TrafficJudge:
        return self.pipeline.judge

    async def __call__(self, batch: TrafficBatch, records: list[TrafficRecord]) -> dict[str, int]:
        """Return the answer's counts; raise :class:`NotTakenHere` for a 503."""
        if self.publisher is not None:
            return await self.publisher.publish(batch, records)
        if self.membership is not None and len(self.membership.live) > 1:
            self._log_refusal(len(self.membership.live))
            raise NotTakenHere(
                f"{len(self.membership.live)} replicas are live and traffic.source is http: posted "
                "traffic is judged once only through the stream; set traffic.source: jetstream"
            )
        return await self.pipeline.take(batch.gateway, arrivals(records, batch.dropped))

    def _log_refusal(self, replicas: int) -> None:
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSAL_LOG_SECONDS:
            self._refusal_logged_at = now
            log.warning(
                "traffic: refusing posted traffic (503): %d replicas are live and traffic.source is "
                "http; set traffic.source: jetstream so that each record is judged once",
                replicas,
            )


class StreamPublisher:
    """Publishes posted records to the traffic stream through the consumer's own connection."""

    def __init__(self, cfg: JetStreamConfig, connection: Callable[[], tuple[JetStreamContext, int] | None]):
        """``connection``: the JetStream context and the server's ``max_payload`` while connected
        (``TrafficStream.connection``), else None."""
        self.cfg = cfg
        self._connection = connection

    async def publish(self, batch: TrafficBatch, records: list[TrafficRecord]) -> dict[str, int]:
        """Publish ``records`` as the tap would; return the answer once JetStream took them all."""
        answer = dict.fromkeys(ANSWER_KEYS, 0)
        connection = self._connection()
        if connection is None:
            raise NotTakenHere(f"the traffic stream at {self.cfg.url} is not connected; try again")
        js, max_payload = connection
        limit = message_limit(max_payload)
        # Off the loop, with the bodies' readers: a batch of the largest records is 60 MB of JSON.
        messages = await read_off_loop(functools.partial(self._messages, batch, records), limit)
        if messages and batch.dropped:  # the drop report rides with the first message, as the tap's
            messages[0][2][DROPPED_HEADER] = str(batch.dropped)
        acks = await asyncio.gather(
            *(js.publish(subject, payload, headers=headers) for subject, payload, headers, _ in messages),
            return_exceptions=True,
        )
        failed = [ack for ack in acks if isinstance(ack, BaseException)]
        if failed:
            raise NotTakenHere(f"the traffic stream did not take the records ({_why(failed[0])}); try again")
        answer["accepted"] = len(records)
        return answer

    def _messages(self, batch: TrafficBatch, records: list[TrafficRecord], limit: int) -> list[Message]:
        """Return ``records`` as the tap's messages (``messages_of``), under ``batch``'s id, or one of
        their own for a batch without: its messages must not be taken for another batch's within
        the stream's duplicate window."""
        dumped = [r.model_dump() for r in records]
        batch_id = batch.batch or uuid.uuid4().hex
        prefix = self.cfg.subject_prefix
        return messages_of(batch_id, batch.gateway, dumped, self.cfg.partitions, prefix, limit)


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
