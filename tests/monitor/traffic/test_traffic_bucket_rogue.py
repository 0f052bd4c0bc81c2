"""A rogue writer of the partitions' KV bucket, on the real NATS, against a real replica: forged
claims and 300 fake replica heartbeats starve it, and its metric
(``kvcanary_traffic_stream_bucket_anomalies``, read as Prometheus scrapes it) says so until the
writer stops; its log names at most ``LOGGED_REPLICAS`` of the replicas it sees.

The machine's NATS has no permissions, as a server whose taps share the monitors' token: any
client writes the bucket. ``docs/nats-permissions.conf`` takes that right from the taps
(``test_traffic_jetstream_permissions.py``); this is what a replica sees where something still can.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.monitor.metrics.stream import StreamCollector
from kvcanary.monitor.traffic.jetstream import TrafficStream
from kvcanary.monitor.traffic.partitions import LEASE_SECONDS, LOGGED_REPLICAS, MAX_REPLICAS, STEP_SECONDS
from kvcanary.monitor.traffic.stream_setup import verify
from tests.support.jetstream import NATS_URL, StreamNames, in_process, until, within

pytestmark = pytest.mark.external_service

FAKE_REPLICAS = 300


def anomalies(stream: TrafficStream) -> dict[str, float]:
    """Return ``kvcanary_traffic_stream_bucket_anomalies`` by kind, scraped from ``stream``'s report."""
    registry = CollectorRegistry()
    registry.register(StreamCollector(stream.report))
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name == "kvcanary_traffic_stream_bucket_anomalies":
            found = {sample.labels["kind"]: sample.value for sample in family.samples}
    return found


async def settled(stream: TrafficStream, timeout: float = 30.0) -> dict[str, float]:
    """Return the anomalies once two readings two steps apart agree (each claim is counted at the
    step that sees it held over a lease: on a loaded machine, some a step after the others)."""
    last = anomalies(stream)
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(2 * STEP_SECONDS)
        now = anomalies(stream)
        if now == last:
            return now
        last = now
    return last


async def reaching(
    stream: TrafficStream, expected: dict[str, float], timeout: float = 30.0
) -> dict[str, float]:
    """Return the anomalies once they read ``expected``, or the last reading after ``timeout``.

    Two readings that agree are not enough where each claim is counted only after a lease: one
    whose count started over (its forged key lapsed for a step on a loaded machine, where the
    rogue's writes and the replica's steps share one loop) reads one short for a whole lease,
    longer than the two steps between readings (15 of 16, twice, beside a second suite)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (now := anomalies(stream)) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(STEP_SECONDS / 2)
    return now


async def keep_writing(bucket: KeyValue, write: Callable[[KeyValue], Awaitable[None]]) -> None:
    """Write as a rogue client does, every second, within every lease, until cancelled. A write the
    server did not answer in time is the rogue's loss, not the test's (300 puts at once, beside a
    second suite, timed out)."""
    while True:
        with contextlib.suppress(nats.errors.TimeoutError):
            await write(bucket)
        await asyncio.sleep(1.0)


async def under_a_rogue_writer(
    tmp_path: Path,
    names: StreamNames,
    write: Callable[[KeyValue], Awaitable[None]],
    expected: dict[str, float] | None = None,
) -> tuple[dict[str, float], tuple[int, ...], dict[str, float], list[int]]:
    """Run one replica while ``write`` keeps forging the bucket, then after it stops; return the
    anomalies and partitions held under the writer (once they read ``expected``, where given, else
    once settled), and after it."""
    cfg = names.settings()
    _, ingest = in_process(tmp_path, cfg)
    await verify(cfg, None)  # the stream, its consumers and the bucket, as serve makes them
    client = await nats.connect(NATS_URL)
    bucket = await client.jetstream(timeout=30).key_value(cfg.bucket)
    await write(bucket)  # before the replica's first step
    rogue = asyncio.get_running_loop().create_task(keep_writing(bucket, write))
    stream = TrafficStream(cfg, ingest, "replica-a", None)
    stream.start()
    try:
        await until("the replica's steps to see the bucket", lambda: any(anomalies(stream).values()))
        await asyncio.sleep(LEASE_SECONDS + 4)  # a hand-over takes a step; withheld counts after a lease
        # A step late under load counts its last claim a step later.
        during = await (settled(stream) if expected is None else reaching(stream, expected))
        held = tuple(stream.report()["partitions"])
        rogue.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await rogue
        await until("the forged keys to lapse", lambda: not any(anomalies(stream).values()), timeout=45)
        await until("every partition held", lambda: len(stream.report()["partitions"]) == cfg.partitions)
        return during, held, anomalies(stream), list(stream.report()["partitions"])
    finally:
        rogue.cancel()
        await stream.stop()
        await client.close()


def test_forged_claims_starve_the_replica_and_its_metric_says_so(
    tmp_path: Path, stream_names: StreamNames
) -> None:
    async def forge_claims(bucket: KeyValue) -> None:
        for n in range(16):
            await bucket.put(f"partition.{n}", b"ghost")

    starved = {"replicas_over_limit": 0, "claims_without_heartbeat": 16, "partitions_withheld": 16}
    during, held, after, held_after = asyncio.run(
        within(150, under_a_rogue_writer(tmp_path, stream_names, forge_claims, starved))
    )
    assert held == ()  # starved: every partition is claimed by a replica that does not exist
    assert during == starved
    assert after == dict.fromkeys(during, 0) and held_after == list(range(16))


def test_300_fake_heartbeats_are_more_replicas_than_plausible_and_logged_bounded(
    tmp_path: Path, stream_names: StreamNames, caplog: pytest.LogCaptureFixture
) -> None:
    async def fake_heartbeats(bucket: KeyValue) -> None:
        await asyncio.gather(*(bucket.put(f"replica.fake-{i:03d}", b"alive") for i in range(FAKE_REPLICAS)))

    caplog.set_level(logging.INFO, logger="kvcanary.traffic")
    during, held, after, held_after = asyncio.run(
        within(120, under_a_rogue_writer(tmp_path, stream_names, fake_heartbeats))
    )
    # The fakes top most partitions and never claim them: this replica holds only its own share.
    assert len(held) < 16
    assert during["replicas_over_limit"] == FAKE_REPLICAS + 1 - MAX_REPLICAS
    assert after == dict.fromkeys(during, 0) and held_after == list(range(16))
    lines = [r.getMessage() for r in caplog.records if "replica(s) live" in r.getMessage()]
    crowded = [line for line in lines if line.startswith(f"traffic stream: {FAKE_REPLICAS + 1} replica(s)")]
    assert crowded, lines
    for line in lines:
        assert line.count("fake-") <= LOGGED_REPLICAS and len(line) < 500, line
    assert f"and {FAKE_REPLICAS + 1 - LOGGED_REPLICAS} more" in crowded[0]


def test_two_replicas_sharing_the_bucket_read_no_anomaly(tmp_path: Path, stream_names: StreamNames) -> None:
    """Without a rogue writer, two replicas that share the partitions read nothing forged: the
    metric stays 0 once they have shared them out (no false alarm from the hand-over)."""
    cfg = stream_names.settings()
    _, ingest = in_process(tmp_path, cfg)

    async def run() -> list[dict[str, float]]:
        await verify(cfg, None)
        replicas = [TrafficStream(cfg, ingest, name, None) for name in ("replica-a", "replica-b")]
        for replica in replicas:
            replica.start()
        try:
            await until(
                "the two replicas to share the partitions",
                lambda: (
                    sorted(len(r.report()["partitions"]) for r in replicas)[0] > 0
                    and sum(len(r.report()["partitions"]) for r in replicas) == cfg.partitions
                ),
            )
            seen = []
            for _ in range(4):  # over two leases
                await asyncio.sleep(LEASE_SECONDS / 2)
                seen += [anomalies(r) for r in replicas]
            return seen
        finally:
            await asyncio.gather(*(r.stop() for r in replicas))

    # Every wait in it is bounded (the sharing by until(), each stop by its own): past 180 s one is
    # not, and within() names where it waits. (A stop whose cancellation nats-py lost waited for
    # ever, and a bare TimeoutError said nothing: test_traffic_jetstream_faults.py has that stop.)
    seen = asyncio.run(within(180, run()))
    assert seen == [dict.fromkeys(seen[0], 0)] * len(seen) and len(seen[0]) == 3
