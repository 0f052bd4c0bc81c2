"""The quarantine set watched in the monitors' JetStream KV bucket (``kvcanary/tap/containment/bucket.py``),
on a real NATS: the monitor's own publisher (``monitor/containment/bucket.py``) puts each set,
signed, and a tap's watch takes it within a moment, keeps the last set through anything it cannot
read or refuses (a value not the contract's, a bucket not there yet, NATS gone), says so once and in
the gateway's gauges, and watches again once it can. What a rogue writer's values do:
``test_forged.py``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from prometheus_client import REGISTRY

from kvcanary.monitor.config.settings import ContainmentSigningConfig, JetStreamConfig
from kvcanary.monitor.containment.bucket import QuarantineBucket
from kvcanary.processes import wait_until
from kvcanary.tap.containment import watch_from_env
from kvcanary.tap.containment.bucket import BucketWatch
from kvcanary.wire import QUARANTINE_KEY
from tests.support.jetstream import NATS_URL, OwnNats, StreamNames
from tests.support.signing import SHARED, SigningKeys, document, make_keys


@pytest.fixture
def keys(tmp_path: Path) -> SigningKeys:
    return make_keys(tmp_path / "keys")


class Monitor:
    """The monitor's publisher on a connection of its own, signing with ``keys``, run from sync
    code. ``signing`` is its ``containment_signing`` (its renewal and expiry)."""

    def __init__(
        self,
        names: StreamNames,
        keys: SigningKeys,
        url: str = NATS_URL,
        signing: ContainmentSigningConfig | None = None,
    ):
        self.cfg = JetStreamConfig.model_validate(names.config(url))
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.client: Any = None
        self.now = 0.0  # the publisher's clock, moved by the test
        self.signer = keys.signer
        self.signing = signing or ContainmentSigningConfig()
        self.bucket = QuarantineBucket(
            self.cfg, self._connection, lambda: self.signer, signing=lambda: self.signing,
            clock=lambda: self.now,
        )  # fmt: skip

    def _connection(self) -> Any:
        if self.client is None or not self.client.is_connected:
            return None
        return self.client.jetstream(timeout=5), self.client.max_payload

    def connect(self) -> Monitor:
        self.client = self.loop.run_until_complete(nats.connect(self.url, allow_reconnect=False))
        return self

    def publish(self, doc: dict[str, Any]) -> bool:
        return self.loop.run_until_complete(self.bucket.publish(doc))

    def held(self) -> bytes:
        """The bucket's value, as it is now."""

        async def read() -> bytes:
            kv = await self.client.jetstream(timeout=5).key_value(self.cfg.quarantine_bucket)
            return bytes((await kv.get(QUARANTINE_KEY)).value or b"")

        return self.loop.run_until_complete(read())

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
def monitor(stream_names: StreamNames, keys: SigningKeys) -> Iterator[Monitor]:
    found = Monitor(stream_names, keys).connect()
    yield found
    found.close()


def watching(names: StreamNames, keys: SigningKeys, url: str = NATS_URL, **options: Any) -> BucketWatch:
    """A tap's watch of ``names``' bucket, holding ``keys``' public key."""
    return BucketWatch(
        url, bucket=names.quarantine_bucket, keys=keys.public_keys, poll_seconds=0.2, **options
    )


def unreadable() -> float | None:
    """The gateway's gauge: 1 while any live watch of this process cannot read (other tests' too,
    so only its 1 says something of this test's watch)."""
    return REGISTRY.get_sample_value("kvcanary_tap_quarantine_unreadable")


def test_a_watch_takes_the_set_the_monitor_puts_and_each_change(
    monitor: Monitor, stream_names: StreamNames, keys: SigningKeys
) -> None:
    assert monitor.publish(document("shared"))
    watch = watching(stream_names, keys)
    try:
        wait_until("the set read", lambda: watch.quarantined(SHARED + "/v1"), timeout=10)
        assert watch.quarantined(SHARED).incident_id == 42 and not watch.failing  # type: ignore[union-attr]
        assert watch.current.key_id == keys.key_id and watch.current.revision == 1
        changed = time.monotonic()
        monitor.publish(document("other", revision=2))
        wait_until(
            "the lift taken",
            lambda: watch.quarantined(SHARED) is None and watch.quarantined("http://other:1"),
        )
        print(f"\na change reached the watch {1000 * (time.monotonic() - changed):.0f} ms after the put")
    finally:
        watch.close()


def refused(reason: str) -> float:
    """The gateway's count of values refused for ``reason`` (every watch of this process)."""
    return REGISTRY.get_sample_value("kvcanary_tap_quarantine_refused_total", {"reason": reason}) or 0.0


def test_a_value_not_the_contracts_is_refused_the_last_set_kept_and_a_fresh_gateway_says_so(
    monitor: Monitor, stream_names: StreamNames, keys: SigningKeys, caplog: pytest.LogCaptureFixture
) -> None:
    monitor.publish(document("shared"))
    watch = watching(stream_names, keys)
    try:
        wait_until("the set read", lambda: watch.quarantined(SHARED))
        assert not watch.failing
        before = refused("malformed")
        with caplog.at_level(logging.WARNING, "kvcanary.tap"):
            monitor.put_raw(b'{"version": 2, "deployments": "all of them", "signatures": [1]}')
            wait_until("the bad value refused", lambda: watch.refused["malformed"] == 1)
            monitor.put_raw(b"not json")
            wait_until("the second refused", lambda: watch.refused["malformed"] == 2)
        assert (
            watch.quarantined(SHARED) is not None and refused("malformed") >= before + 2
        )  # the last set holds
        said = [r for r in caplog.records if "refused a quarantine set" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]  # once a minute, not once a value
        # A gateway started now finds no set the monitors signed: it says so and stays so (it has none).
        fresh = watching(stream_names, keys)
        try:
            wait_until("the fresh watch's failure", lambda: fresh.failing)
            time.sleep(0.6)  # a few watches anew: none may take the bucket's value
            assert fresh.failing and fresh.snapshot().empty and unreadable() == 1.0
        finally:
            fresh.close()
        monitor.publish(document(revision=2))  # the monitor's next change puts a signed set
        wait_until("a good set read again", lambda: watch.quarantined(SHARED) is None)
    finally:
        watch.close()


def test_a_watch_started_before_any_monitor_reads_the_set_once_one_puts_it(
    monitor: Monitor, stream_names: StreamNames, keys: SigningKeys
) -> None:
    watch = watching(stream_names, keys)
    try:
        wait_until("the missing bucket noted", lambda: watch.failing)
        assert watch.snapshot().empty
        monitor.publish(document("shared"))
        wait_until("the set read", lambda: watch.quarantined(SHARED) and not watch.failing)
    finally:
        watch.close()


def test_nats_gone_keeps_the_last_set_and_the_watch_comes_back_with_it(
    tmp_path: Path, keys: SigningKeys
) -> None:
    server = OwnNats(tmp_path / "store").start()
    names = StreamNames("KVC_Q", "kvc_q_partitions", "kvcq", "kvc_q_quarantine")
    monitor = Monitor(names, keys, server.url).connect()
    watch = watching(names, keys, server.url)
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
        monitor = Monitor(names, keys, server.url).connect()
        monitor.publish(document(revision=2))
        wait_until("the lift after the restart", lambda: watch.quarantined(SHARED) is None)
    finally:
        watch.close()
        monitor.close()
        server.stop()


def test_a_tap_on_nats_watches_the_bucket_with_its_own_credentials_and_the_monitors_keys(
    monkeypatch: pytest.MonkeyPatch, keys: SigningKeys, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCANARY_TAP_URL", NATS_URL)
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE", "1")
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE_BUCKET", "kvc_other_bucket")
    monkeypatch.setenv("KVCANARY_TAP_GATEWAY", "gw-east")
    with pytest.raises(Exception, match="KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS: set it"):
        watch_from_env()  # a tap that quarantines takes only a signed set: it needs the keys
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS", "not-a-key")
    with pytest.raises(Exception, match="KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS: 'not-a-key'"):
        watch_from_env()
    monkeypatch.delenv("KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS")
    two = tmp_path / "two-keys"  # a rotation's: the new key beside the old
    two.write_text(keys.public.read_text() + make_keys(tmp_path / "new").public.read_text())
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS_FILE", str(two))
    watch = watch_from_env()
    try:
        assert isinstance(watch, BucketWatch) and watch.bucket == "kvc_other_bucket"
        assert watch.gateway == "gw-east" and len(watch.keys) == 2 and keys.key_id in watch.keys
    finally:
        assert watch is not None
        watch.close()
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE_BUCKET", "no spaces.allowed")
    with pytest.raises(Exception, match="KVCANARY_TAP_QUARANTINE_BUCKET"):
        watch_from_env()
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE_BUCKET", "kvc_other_bucket")
    monkeypatch.setenv("KVCANARY_TAP_QUARANTINE_STALE_SECONDS", "0")
    with pytest.raises(Exception, match="KVCANARY_TAP_QUARANTINE_STALE_SECONDS"):
        watch_from_env()
    assert json.dumps(document())  # the document helper stays JSON
