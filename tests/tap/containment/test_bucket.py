"""The quarantine set watched in the monitors' JetStream KV bucket (``kvcanary/tap/containment/bucket.py``),
on a real NATS: the monitor's own publisher (``monitor/containment/bucket.py``) puts each set,
and a tap's watch takes it within a moment, keeps the last set through anything it cannot read
(a value not the contract's, a bucket not there yet, NATS gone), says so once and in the gateway's
gauge, and watches again once it can."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from prometheus_client import REGISTRY

from kvcanary.monitor.config.settings import JetStreamConfig
from kvcanary.monitor.containment.bucket import QuarantineBucket
from kvcanary.tap.containment import watch_from_env
from kvcanary.tap.containment.bucket import BucketWatch
from kvcanary.wire import QUARANTINE_KEY
from tests.support.jetstream import NATS_URL, OwnNats, StreamNames, wait_until

SHARED = "http://10.0.0.7:8000"


def document(*quarantined: str, incident: int = 42, revision: int = 1) -> dict[str, Any]:
    """A set as the monitor serves it, ``quarantined`` targets each on one deployment."""
    return {
        "version": 1, "revision": revision, "generated_at": datetime.now(UTC).isoformat(),
        "deployments": [
            {"target": t, "api_bases": [SHARED if t == "shared" else f"http://{t}:1"], "enforced": True,
             "cause": "incident", "incident_id": incident, "reason": "a leak",
             "since": "2026-12-05T07:00:00Z"}
            for t in quarantined
        ],
        "guards": [],
    }  # fmt: skip


class Monitor:
    """The monitor's publisher on a connection of its own, run from sync code."""

    def __init__(self, names: StreamNames, url: str = NATS_URL):
        self.cfg = JetStreamConfig.model_validate(names.config(url))
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.client: Any = None
        self.now = 0.0  # the publisher's clock, moved by the test
        self.bucket = QuarantineBucket(self.cfg, self._connection, clock=lambda: self.now)

    def _connection(self) -> Any:
        if self.client is None or not self.client.is_connected:
            return None
        return self.client.jetstream(timeout=5), self.client.max_payload

    def connect(self) -> Monitor:
        self.client = self.loop.run_until_complete(nats.connect(self.url, allow_reconnect=False))
        return self

    def publish(self, doc: dict[str, Any]) -> bool:
        return self.loop.run_until_complete(self.bucket.publish(doc))

    def put_raw(self, value: bytes) -> None:
        async def put() -> None:
            kv = await self.client.jetstream(timeout=5).key_value(self.cfg.quarantine_bucket)
            await kv.put(QUARANTINE_KEY, value)

        self.loop.run_until_complete(put())

    def revision(self) -> int:
        async def last() -> int:
            kv = await self.client.jetstream(timeout=5).key_value(self.cfg.quarantine_bucket)
            return int((await kv.get(QUARANTINE_KEY)).revision or 0)

        return self.loop.run_until_complete(last())

    def close(self) -> None:
        if self.client is not None and self.client.is_connected:
            self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture
def monitor(stream_names: StreamNames) -> Iterator[Monitor]:
    found = Monitor(stream_names).connect()
    yield found
    found.close()


def unreadable() -> float | None:
    """The gateway's gauge: 1 while any live watch of this process cannot read (other tests' too,
    so only its 1 says something of this test's watch)."""
    return REGISTRY.get_sample_value("kvcanary_tap_quarantine_unreadable")


def test_a_watch_takes_the_set_the_monitor_puts_and_each_change(
    monitor: Monitor, stream_names: StreamNames
) -> None:
    assert monitor.publish(document("shared"))
    watch = BucketWatch(NATS_URL, bucket=stream_names.quarantine_bucket, poll_seconds=0.2)
    try:
        wait_until("the set read", lambda: watch.quarantined(SHARED + "/v1"), timeout=10)
        assert watch.quarantined(SHARED).incident_id == 42 and not watch.failing  # type: ignore[union-attr]
        changed = time.monotonic()
        monitor.publish(document("other", revision=2))
        wait_until(
            "the lift taken",
            lambda: watch.quarantined(SHARED) is None and watch.quarantined("http://other:1"),
        )
        print(f"\na change reached the watch {1000 * (time.monotonic() - changed):.0f} ms after the put")
    finally:
        watch.close()


def test_a_value_not_the_contracts_keeps_the_last_set_and_the_gauge_says_so(
    monitor: Monitor, stream_names: StreamNames, caplog: pytest.LogCaptureFixture
) -> None:
    monitor.publish(document("shared"))
    watch = BucketWatch(NATS_URL, bucket=stream_names.quarantine_bucket, poll_seconds=0.2)
    try:
        wait_until("the set read", lambda: watch.quarantined(SHARED))
        assert not watch.failing
        with caplog.at_level(logging.WARNING, "kvcanary.tap"):
            monitor.put_raw(b'{"version": 1, "deployments": "all of them"}')
            wait_until("the bad value noted", lambda: watch.failing)
            monitor.put_raw(b"not json")
            time.sleep(0.5)
        assert watch.quarantined(SHARED) is not None and unreadable() == 1.0  # the last set holds
        said = [r for r in caplog.records if "cannot read the quarantine" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]  # once per outage
        # A gateway started now finds no readable set: it says so and stays so (it has none).
        fresh = BucketWatch(NATS_URL, bucket=stream_names.quarantine_bucket, poll_seconds=0.2)
        try:
            wait_until("the fresh watch's failure", lambda: fresh.failing)
            time.sleep(0.6)  # a few watches anew: none may call the bucket read
            assert fresh.failing and fresh.snapshot().empty
        finally:
            fresh.close()
        monitor.publish(document(revision=2))  # the monitor's next change puts a readable set
        wait_until("a good set read again", lambda: not watch.failing and watch.quarantined(SHARED) is None)
    finally:
        watch.close()


def test_a_watch_started_before_any_monitor_reads_the_set_once_one_puts_it(
    monitor: Monitor, stream_names: StreamNames
) -> None:
    watch = BucketWatch(NATS_URL, bucket=stream_names.quarantine_bucket, poll_seconds=0.2)
    try:
        wait_until("the missing bucket noted", lambda: watch.failing)
        assert watch.snapshot().empty
        monitor.publish(document("shared"))
        wait_until("the set read", lambda: watch.quarantined(SHARED) and not watch.failing)
    finally:
        watch.close()


def test_nats_gone_keeps_the_last_set_and_the_watch_comes_back_with_it(tmp_path: Path) -> None:
    server = OwnNats(tmp_path / "store").start()
    names = StreamNames("KVC_Q", "kvc_q_partitions", "kvcq", "kvc_q_quarantine")
    monitor = Monitor(names, server.url).connect()
    watch = BucketWatch(server.url, bucket=names.quarantine_bucket, poll_seconds=0.2)
    try:
        monitor.publish(document("shared"))
        wait_until("the set read", lambda: watch.quarantined(SHARED))
        monitor.close()
        server.stop()
        wait_until("NATS gone noted", lambda: watch.failing)
        time.sleep(0.5)
        assert watch.quarantined(SHARED) is not None  # kept while nobody can be asked
        server.start()  # the same store: the bucket and its set are still there
        wait_until("watched again", lambda: not watch.failing, timeout=15)
        monitor = Monitor(names, server.url).connect()
        monitor.publish(document(revision=2))
        wait_until("the lift after the restart", lambda: watch.quarantined(SHARED) is None)
    finally:
        watch.close()
        monitor.close()
        server.stop()


def test_a_tap_on_nats_watches_the_bucket_with_its_own_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_TAP_URL", NATS_URL)
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE", "1")
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE_BUCKET", "kvc_other_bucket")
    watch = watch_from_env()
    try:
        assert isinstance(watch, BucketWatch) and watch.bucket == "kvc_other_bucket"
    finally:
        assert watch is not None
        watch.close()
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE_BUCKET", "no spaces.allowed")
    with pytest.raises(Exception, match="KVCANARY_TAP_QUARANTINE_BUCKET"):
        watch_from_env()
    assert json.dumps(document())  # the document helper stays JSON
