"""``traffic.source: jetstream`` on the real NATS server, one monitor in process: records published
by the real tap are judged exactly once through a consumer that took and did not acknowledge, a
NATS restart, a consumer cut at a hand-over while storing; a bad record costs only itself; a stream
carries more than its size. Replicas as processes: ``test_traffic_jetstream_serve.py``.

Exactly once is counted where it lands: the per-minute counts (``traffic_minute.records``, every
judged record adds one) and the judged ids (``traffic_judged``), against the records sent.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import nats
import pytest
from sqlalchemy import select

from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.monitor.storage.judged_rows import mark_judged, prune_judged
from kvcanary.monitor.storage.models import TrafficJudged
from kvcanary.monitor.storage.retention import in_batches
from kvcanary.monitor.traffic.jetstream import TrafficStream
from kvcanary.monitor.traffic.messages import decode
from kvcanary.monitor.traffic.stream_setup import durable_name, verify
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.jetstream import partition_of
from kvcanary.tap.record import Exchange, summarize
from kvcanary.wire import VERSION
from tests.support.jetstream import (
    BASE,
    KEY,
    NATS_URL,
    OwnNats,
    Port,
    StreamNames,
    counted,
    exchange,
    in_process,
    new_names,
    tap,
    until,
)

pytestmark = pytest.mark.external_service


# --- one monitor, in process ---------------------------------------------------------------------


def test_a_redelivery_after_a_consumer_that_took_and_did_not_ack_is_judged_once(
    tmp_path: Path, stream_names: StreamNames
) -> None:
    """A replica pulled ten records and died: five it had judged (stored, marked) but not yet
    acknowledged, five it had not judged. The live monitor judges the other ten at once, and the
    ten again after ack_wait: the five judged are acknowledged without judging, the five are judged."""
    cfg = stream_names.settings(ack_wait_seconds=1, duplicate_window_seconds=10)
    factory, ingest = in_process(tmp_path, cfg)
    partition = partition_of(BASE, 16)

    async def run() -> None:
        await verify(cfg, None)  # the stream, the consumers and the bucket, as serve makes them
        sender = tap(stream_names, batch_records=1)  # a message a record: the dying replica takes ten
        for i in range(20):
            sender.put(exchange(i))
        while sender.sent < 20:
            await asyncio.sleep(0.05)
        sender.close()
        client = await nats.connect(NATS_URL)
        js = client.jetstream(timeout=5)
        await js.publish(
            f"{cfg.subject_prefix}.{partition}", b"{not a record"
        )  # malformed: acked, never again
        dying = await js.pull_subscribe_bind(durable=durable_name(partition), stream=cfg.stream)
        taken = await dying.fetch(10, timeout=2)
        assert len(taken) == 10 and all(m.metadata.num_delivered == 1 for m in taken)
        pulled = [p for message in taken[5:] for p in decode(message)[0]]
        await ingest.take("gw-1", pulled)
        await dying.unsubscribe()  # ... and dies: nothing acknowledged
        stream = TrafficStream(cfg, ingest, "replica-a", None)
        stream.start()
        try:
            deadline = time.monotonic() + 30
            while stream.judged + stream.duplicates < 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.5)  # past ack_wait twice: nothing is left to come again
            info = await js.consumer_info(cfg.stream, durable_name(partition))
        finally:
            await stream.stop()
            await client.close()
        # Five or more not judged again: on a loaded machine a batch may outlast ack_wait and come again.
        assert (stream.judged, stream.rejected) == (15, 1) and stream.duplicates >= 5
        assert info.num_ack_pending == 0 and info.num_pending == 0

    asyncio.run(asyncio.wait_for(run(), 60))
    assert counted(factory) == (20, 20)  # twenty records, each judged and marked once


def test_a_bad_record_in_a_tap_batchs_message_costs_only_itself(
    tmp_path: Path, stream_names: StreamNames
) -> None:
    cfg = stream_names.settings()
    factory, ingest = in_process(tmp_path, cfg)
    fingerprints = Fingerprinter(KEY)
    good = [json.dumps(summarize(exchange(i), fingerprints)).encode() for i in range(3)]
    body = b'{"records":[' + b",".join([good[0], b'{"id": 7}', good[1], b"null", good[2]]) + b"]}"

    async def run() -> tuple[int, int]:
        await verify(cfg, None)
        client = await nats.connect(NATS_URL)
        headers = {"Kvcanary-Version": str(VERSION), "Kvcanary-Records": "5", "Kvcanary-Gateway": "gw-1",
                   "Nats-Msg-Id": "one-batch.0"}  # fmt: skip
        await client.jetstream(timeout=5).publish(
            f"{cfg.subject_prefix}.{partition_of(BASE, 16)}", body, headers=headers
        )
        await client.close()
        stream = TrafficStream(cfg, ingest, "replica-a", None)
        stream.start()
        try:
            await until("five records judged or rejected", lambda: stream.judged + stream.rejected >= 5)
        finally:
            await stream.stop()
        return stream.judged, stream.rejected

    assert asyncio.run(run()) == (3, 2)
    assert counted(factory) == (3, 3)


def test_a_batch_cut_at_a_hand_over_while_being_stored_is_recorded_too(
    tmp_path: Path, stream_names: StreamNames, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer of a partition handed over is cut after STOP_WAIT_SECONDS; its batch's rows and
    marks commit in the database's thread all the same, so its results must reach the port too:
    the redelivery finds the marks and records nothing."""
    cfg = stream_names.settings()
    port = Port()
    factory, ingest = in_process(tmp_path, cfg, port)
    writing = threading.Event()
    write = ingest._write

    def slow_write(*args: Any) -> None:  # a database slower than the hand-over
        writing.set()
        time.sleep(1.0)
        write(*args)

    monkeypatch.setattr(ingest, "_write", slow_write)

    async def run() -> None:
        await verify(cfg, None)
        sender = tap(stream_names)
        for i in range(5):
            sender.put(exchange(i))
        stream = TrafficStream(cfg, ingest, "replica-a", None, stop_wait_seconds=0.1)
        stream.start()
        try:
            await until("a batch being stored", writing.is_set)
        finally:
            await stream.stop()  # releases its partitions: the cut
            await asyncio.to_thread(sender.close, 2)

    asyncio.run(asyncio.wait_for(run(), 60))
    assert counted(factory) == (5, 5)
    assert "traffic_marker" in {item.kind for item in port.items}  # every record passed it


def test_a_nats_restart_under_the_consumer_loses_nothing_and_judges_nothing_twice(
    tmp_path: Path, own_nats: OwnNats
) -> None:
    names = new_names()
    cfg = names.settings(own_nats.start().url, ack_wait_seconds=2, duplicate_window_seconds=10)
    factory, ingest = in_process(tmp_path, cfg)

    async def run() -> None:
        await verify(cfg, None)
        sender = tap(names, own_nats.url)
        stream = TrafficStream(cfg, ingest, "replica-a", None)
        stream.start()
        try:
            for i in range(20):
                sender.put(exchange(i))
            await until("the first records judged", lambda: stream.judged == 20)
            await asyncio.to_thread(own_nats.stop)  # what comes meanwhile waits in the tap
            for i in range(20, 35):
                sender.put(exchange(i))
            await asyncio.to_thread(own_nats.start)  # the same store: the stream and its consumers
            await until("the records of the restart judged", lambda: stream.judged == 35, timeout=60)
            await asyncio.sleep(cfg.ack_wait_seconds + 1)  # a record judged twice would come meanwhile
        finally:
            await stream.stop()
            await asyncio.to_thread(sender.close, 2)
        assert (stream.judged, stream.rejected) == (35, 0)

    asyncio.run(asyncio.wait_for(run(), 120))
    assert counted(factory) == (35, 35)


def test_a_stream_smaller_than_the_traffic_through_it_keeps_taking_what_is_judged(
    tmp_path: Path, stream_names: StreamNames
) -> None:
    """``max_bytes`` bounds what waits unjudged, not all that ever passed: a monitor that keeps up
    carries three times the stream's size through it, nothing refused, nothing dropped."""
    cfg = stream_names.settings(max_bytes=1024**2)
    factory, ingest = in_process(tmp_path, cfg)
    words = 6000  # 1,024 prints each way: about 21 kB a record, 48 to the stream's MiB

    def large(i: int) -> Exchange:
        text = " ".join(f"w{i}x{j}" for j in range(words))
        return Exchange(f"big-{i}", time.time(), f"team-{i % 3}", "team", BASE, prompt=text, response=text)

    async def run() -> None:
        await verify(cfg, None)
        stream = TrafficStream(cfg, ingest, "replica-a", None)
        stream.start()
        sender = tap(stream_names)
        try:
            for i in range(150):
                sender.put(large(i))
            # 3 MB of records judged at the machine's pace: over 45 s beside a second suite on 2 cores.
            await until("every record judged", lambda: stream.judged == 150, timeout=150)
        finally:
            await stream.stop()
            await asyncio.to_thread(sender.close, 2)
        assert (sender.sent, sender.dropped) == (150, 0)

    asyncio.run(asyncio.wait_for(run(), 180))
    assert counted(factory) == (150, 150)


def test_judged_ids_are_kept_counted_from_the_newest_so_a_long_outage_prunes_none_too_early(
    tmp_path: Path,
) -> None:
    """Every replica was down an hour, longer than the ids are kept (30 min): the records judged
    just before, not acknowledged, come again first thing; their ids must outlive the first prune."""
    url = f"sqlite:///{tmp_path / 'kvcanary.db'}"
    upgrade(url)
    factory = make_session_factory(make_engine(url))
    now = datetime.now(UTC)
    with factory.begin() as s:
        mark_judged(s, [(1, "long-ago")], now - timedelta(hours=3))
        mark_judged(s, [(1, "before-the-outage"), (2, "before-the-outage")], now - timedelta(hours=1))
    prune = partial(prune_judged, keep_seconds=1800)

    def kept() -> set[tuple[int, str]]:
        with factory() as s:
            return {(row.partition, row.record_id) for row in s.scalars(select(TrafficJudged))}

    assert in_batches(factory, prune) == 1
    assert kept() == {(1, "before-the-outage"), (2, "before-the-outage")}
    with factory.begin() as s:  # judging goes on: the ids of before the outage go in their turn
        mark_judged(s, [(3, "after")], now)
    assert in_batches(factory, prune) == 2 and kept() == {(3, "after")}
