"""``traffic.source: jetstream`` through ``kvcanary serve`` processes on the real NATS server and
PostgreSQL: two replicas share the partitions and a killed one's records are judged once; serve
facing a NATS that is not there exits 2 with one line, and names a stream made otherwise than
configured; a reload keeps the consumer going and refuses a change of the stream.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from sqlalchemy import func, select

from kvcanary.monitor.config.settings import ConfigError, TrafficConfig
from kvcanary.monitor.storage.db import make_engine, make_session_factory
from kvcanary.monitor.storage.models import Target, TrafficMinute
from kvcanary.monitor.traffic.partitions import LEASE_SECONDS, STEP_SECONDS
from kvcanary.monitor.traffic.stream_setup import verify
from kvcanary.processes import wait_until
from tests.monitor.served import Served
from tests.support import free_port, own_database, stop_process
from tests.support.jetstream import (
    NATS_URL,
    StreamNames,
    bases_covering,
    counted,
    exchange,
    replica_config,
    shares,
    stream_report,
    tap,
)

pytestmark = pytest.mark.external_service


# --- replicas, as processes on the real PostgreSQL -----------------------------------------------


@pytest.fixture
def database_url(postgres_url: str) -> Iterator[str]:
    yield from own_database("kvcanary_js")


def test_two_replicas_share_the_partitions_and_a_killed_ones_records_are_judged_once(
    served: Callable[[dict[str, Any]], Served], database_url: str, stream_names: StreamNames
) -> None:
    bases = bases_covering(16)
    config = replica_config(database_url, stream_names, bases)
    first = served(config)
    first.start()
    second = served(config)
    second.start(migrate=False)
    replicas = [first, second]
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    sender = tap(stream_names)
    sent = 0

    def state() -> str:
        reports = "\n".join(f"{m.url}: {stream_report(m)}" for m in replicas)
        return f"{reports}\nsent {sent}, counted {counted(factory)}\n" + "\n".join(
            m.log()[-3000:] for m in replicas
        )

    try:
        # Settled, not caught mid-hand-over: while the second replica claims its share a step at a
        # time, the first still judges the rest, and records sent then could all be the first's.
        settled(replicas, timeout=6 * LEASE_SECONDS, state=state)

        def send(n: int) -> None:
            nonlocal sent
            for _ in range(n):
                sender.put(exchange(sent, bases[sent % len(bases)]))
                sent += 1
                time.sleep(0.002)

        send(300)
        wait_until("both replicas to judge", lambda: all(stream_report(m).get("judged") for m in replicas),
                   state=state)  # fmt: skip
        assert first.proc is not None
        os.killpg(first.proc.pid, signal.SIGKILL)  # no goodbye: its claims lapse, its pulls come again
        first.proc.wait(10)
        send(300)
        wait_until(
            "every record acknowledged by the tap", lambda: sender.sent == sent, timeout=30, state=state
        )
        # A lease, a step and ack_wait for the redelivery, on a loaded machine.
        wait_until("every record judged", lambda: counted(factory)[0] >= sent, timeout=LEASE_SECONDS + 30,
                   state=state)  # fmt: skip
        time.sleep(3 + 2 * STEP_SECONDS)  # a record judged twice would land meanwhile
        assert counted(factory) == (sent, sent)
        report = stream_report(second)
        assert len(report["partitions"]) == 16 and report["replicas"] == 1, report
    finally:
        sender.close(timeout=2)
        for monitor in replicas:
            if monitor.proc is not None:
                stop_process(monitor.proc, timeout=30)
        engine.dispose()


def settled(replicas: list[Served], timeout: float, state: Callable[[], str]) -> None:
    """Wait until the replicas share every partition, each some, and the shares have held for two
    steps (a hand-over moves a partition within one)."""
    last: list[list[int]] = []
    since = time.monotonic()

    def held() -> bool:
        nonlocal last, since
        now = [stream_report(m).get("partitions", []) for m in replicas]
        if now != last:
            last, since = now, time.monotonic()
        split = [len(p) for p in now]
        return split in shares(16) and time.monotonic() - since >= 2 * STEP_SECONDS

    wait_until("the replicas to settle on a share of the 16 partitions each", held, timeout=timeout,
               state=state)  # fmt: skip


def test_serve_facing_a_nats_that_is_not_there_exits_2_with_one_line(
    served: Callable[[dict[str, Any]], Served], tmp_path: Path
) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    monitor = served({"traffic": {"source": "jetstream", "jetstream": {"url": dead}}})
    monitor.start(wait=False)
    assert monitor.proc is not None
    assert monitor.proc.wait(60) == 2
    lines = monitor.log().strip().splitlines()
    assert len(lines) == 1, lines
    assert f"cannot reach NATS at {dead}" in lines[0] and "traffic.jetstream.url" in lines[0]
    assert "Traceback" not in monitor.log()


def test_a_stream_or_bucket_made_otherwise_than_configured_is_named_at_start(
    stream_names: StreamNames,
) -> None:
    cfg = stream_names.settings()

    async def run() -> list[str]:
        client = await nats.connect(NATS_URL)
        js = client.jetstream(timeout=5)
        await js.create_key_value(KeyValueConfig(bucket=cfg.bucket, ttl=600))  # another tool's bucket
        refused = []
        for made in (False, True):
            if made:  # and a stream in memory, which no update turns into files
                await js.add_stream(StreamConfig(name=cfg.stream, subjects=[f"{cfg.subject_prefix}.>"],
                                                 storage=StorageType.MEMORY))  # fmt: skip
            with pytest.raises(ConfigError) as err:
                await verify(cfg, None)
            refused.append(str(err.value))
            if not made:
                await js.delete_stream(cfg.stream)
        await client.close()
        return refused

    bucket, stream = asyncio.run(asyncio.wait_for(run(), 30))
    assert bucket.startswith(f"traffic.jetstream.bucket: {cfg.bucket}"), bucket
    assert stream.startswith(f"traffic.jetstream.stream: {cfg.stream}") and "storage" in stream, stream


def test_a_reload_keeps_the_consumer_going_and_refuses_a_change_of_the_stream(
    served: Callable[[dict[str, Any]], Served], stream_names: StreamNames, tmp_path: Path
) -> None:
    bases = ["http://10.3.0.1:8000/v1", "http://10.3.0.2:8000/v1"]
    database_url = f"sqlite:///{tmp_path / 'kvcanary.db'}"
    monitor = served(replica_config(database_url, stream_names, bases[:1]))
    monitor.start()
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    sender = tap(stream_names)

    def judged_for(target: str) -> int:
        with factory() as s:
            query = select(func.coalesce(func.sum(TrafficMinute.records), 0)).join(Target)
            return int(s.scalar(query.where(Target.name == target)) or 0)

    try:
        for i in range(10):
            sender.put(exchange(i, bases[0]))
        wait_until("the first target's records judged", lambda: judged_for("t00") == 10, timeout=30)
        changed = replica_config(database_url, stream_names, bases[:1])
        changed["traffic"]["jetstream"]["ack_wait_seconds"] = 5
        monitor.write_config({**monitor.config, "traffic": changed["traffic"]})
        refused = monitor.post("/-/reload")
        assert refused.status_code == 400 and "traffic.jetstream" in refused.json()["detail"]
        grown = replica_config(database_url, stream_names, bases)
        monitor.write_config({**monitor.config, "targets": grown["targets"], "traffic": grown["traffic"]})
        assert monitor.post("/-/reload").status_code == 200
        for i in range(10, 20):
            sender.put(exchange(i, bases[1]))
        wait_until("the added target's records judged", lambda: judged_for("t01") == 10, timeout=30)
        # Counted once the batch is acknowledged, a moment after its rows are stored.
        wait_until("the consumer to count 20", lambda: stream_report(monitor).get("judged") == 20, timeout=10)
        assert judged_for("t00") == 10
        # The same on /metrics, and a stream drained: nothing pending, no lag once a pull is empty.
        wait_until(
            "an empty pull", lambda: monitor.value("kvcanary_traffic_stream_lag_seconds") == 0, timeout=10
        )
        assert monitor.value("kvcanary_traffic_stream_records_total", outcome="judged") == 20
        assert monitor.value("kvcanary_traffic_stream_records_total", outcome="duplicate") == 0
        assert monitor.value("kvcanary_traffic_stream_connected") == 1
        assert monitor.value("kvcanary_traffic_stream_partitions_held") == 16
        assert monitor.value("kvcanary_traffic_stream_replicas") == 1
        assert monitor.value("kvcanary_traffic_stream_pending_messages") == 0
    finally:
        sender.close(timeout=2)
        monitor.stop()
        engine.dispose()


def test_a_reload_refuses_a_change_of_the_stream_block_only_where_it_is_read() -> None:
    http = TrafficConfig()
    other = TrafficConfig.model_validate({"jetstream": {"ack_wait_seconds": 5}})
    assert http.restart_keys(other) == []  # read neither before nor after
    read = TrafficConfig.model_validate({"source": "jetstream"})
    assert read.restart_keys(read.model_copy(update={"jetstream": other.jetstream})) == ["traffic.jetstream"]
    assert http.restart_keys(read) == ["traffic.source"]
    assert http.restart_keys(other.model_copy(update={"source": "jetstream"})) == [
        "traffic.source",
        "traffic.jetstream",
    ]
