"""The NATS permissions kvcanary documents (``docs/nats-permissions.conf``), on a real nats-server
started from that file: a real tap logged in as ``tap`` publishes records that a real monitor
consumer logged in as ``monitor`` judges, and the tap's credentials can neither write the
partitions' KV bucket (where a writer could starve every replica) nor read anything but its inbox;
they watch the quarantine set the monitors put in its bucket, and cannot write it, and the monitor
hears each tap's acknowledgement of the set it applies.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from kvcanary.monitor.config.settings import JetStreamConfig
from kvcanary.monitor.containment.bucket import QuarantineBucket
from kvcanary.monitor.traffic.jetstream import TrafficStream
from kvcanary.monitor.traffic.stream_setup import connect, prepare, verify
from kvcanary.tap import Tap
from kvcanary.tap.containment.bucket import BucketWatch
from kvcanary.wire import QUARANTINE_KEY
from tests.support import free_port
from tests.support.jetstream import KEY, NATS_SERVER, TEST_MAX_BYTES, counted, exchange, in_process, until
from tests.support.signing import SHARED, document, make_keys

pytestmark = pytest.mark.external_service

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "nats-permissions.conf"
TAP_PASSWORD = "tap-password-for-the-test"
MONITOR_PASSWORD = "monitor-password-for-the-test"


@dataclass(frozen=True)
class Server:
    port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def monitor_config(self) -> JetStreamConfig:
        """The monitor's ``traffic.jetstream``, logged in as the documented ``monitor`` user."""
        return JetStreamConfig.model_validate(
            {"url": self.url, "user": "monitor", "max_bytes": TEST_MAX_BYTES, "ack_wait_seconds": 5,
             "duplicate_window_seconds": 30}
        )  # fmt: skip

    def tap_url(self) -> str:
        """A URL carrying the tap's user and password, for a raw client acting with the tap's
        credentials (the tap itself takes them from KVCANARY_TAP_NATS_USER and _TOKEN)."""
        return f"nats://tap:{TAP_PASSWORD}@127.0.0.1:{self.port}"


@pytest.fixture
def permitted_nats(tmp_path: Path) -> Iterator[Server]:
    """A nats-server on ``docs/nats-permissions.conf``, its port and store the test's own."""
    port = free_port()
    text = EXAMPLE.read_text()
    text = re.sub(r"(?m)^listen: .*$", f"listen: 127.0.0.1:{port}", text)
    text = re.sub(r"(?m)^  store_dir: .*$", f"  store_dir: {tmp_path / 'store'}", text)
    config = tmp_path / "nats.conf"
    config.write_text(text)
    env = {**os.environ, "KVCANARY_NATS_TAP_PASSWORD": TAP_PASSWORD,
           "KVCANARY_NATS_MONITOR_PASSWORD": MONITOR_PASSWORD}  # fmt: skip
    log = tmp_path / "nats.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [NATS_SERVER, "-c", str(config)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = time.monotonic() + 15
        while b"Server is ready" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not start on {config}:\n{log.read_text()}")
            time.sleep(0.05)
        yield Server(port)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_tap_logged_in_as_tap_publishes_what_a_monitor_logged_in_as_monitor_judges(
    tmp_path: Path, permitted_nats: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = permitted_nats.monitor_config()
    factory, ingest = in_process(tmp_path, cfg)
    # The gateway's configuration as an operator writes it: the tap logs in as the `tap` user.
    monkeypatch.setenv("KVCANARY_TAP_URL", permitted_nats.url)
    monkeypatch.setenv("KVCANARY_TAP_NATS_USER", "tap")
    monkeypatch.setenv("KVCANARY_TAP_TOKEN", TAP_PASSWORD)
    monkeypatch.setenv("KVCANARY_TAP_KEY", KEY.decode())
    monkeypatch.setenv("KVCANARY_TAP_GATEWAY", "gw-1")

    async def run() -> None:
        await verify(cfg, MONITOR_PASSWORD)  # the stream, consumers and bucket, as serve makes them
        tap = Tap.from_env(flush_seconds=0.05)
        stream = TrafficStream(cfg, ingest, "replica-a", MONITOR_PASSWORD)
        stream.start()
        try:
            for i in range(20):
                tap.observe(exchange(i))
            await until("the tap's records judged", lambda: stream.judged == 20, timeout=60)
        finally:
            await stream.stop()
            await asyncio.to_thread(tap.close, 2)
        assert (stream.judged, stream.rejected) == (20, 0)

    asyncio.run(asyncio.wait_for(run(), 90))
    assert counted(factory) == (20, 20)


def test_the_taps_credentials_cannot_write_the_bucket_nor_read_other_subjects(permitted_nats: Server) -> None:
    cfg = permitted_nats.monitor_config()

    async def run() -> tuple[list[str], list[bytes | None]]:
        monitor = await connect(cfg, MONITOR_PASSWORD, keep_trying=False)
        bucket = await prepare(monitor.jetstream(timeout=5), cfg)
        refused: list[str] = []

        async def note(error: Exception) -> None:
            refused.append(str(error).lower())

        tap = await nats.connect(permitted_nats.tap_url(), error_cb=note, allow_reconnect=False)
        js = tap.jetstream(timeout=1)
        try:
            # A forged claim, raw and through the KV API, and a forged heartbeat: no PubAck comes.
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish(f"$KV.{cfg.bucket}.partition.0", b"ghost")
            with pytest.raises(nats.errors.TimeoutError):
                await (await js.key_value(cfg.bucket)).put("replica.ghost", b"alive")
            with pytest.raises(nats.errors.TimeoutError):
                await js.add_consumer(cfg.stream, durable_name="tap-reads-the-stream")
            for subject in (f"{cfg.subject_prefix}.>", f"$KV.{cfg.bucket}.>", "_INBOX_kvcanary_monitor.>",
                            "$JS.API.>"):  # fmt: skip
                await tap.subscribe(subject)
            await tap.flush()
            await until("the server's refusals", lambda: len(refused) >= 7, timeout=10)
            return refused, [await _value(bucket, key) for key in ("partition.0", "replica.ghost")]
        finally:
            await tap.close()
            await monitor.close()

    refused, written = asyncio.run(asyncio.wait_for(run(), 60))
    assert written == [None, None]  # nothing of the tap's reached the bucket
    bucket = cfg.bucket.lower()
    for expected in (
        f'publish to "$kv.{bucket}.partition.0"',
        f'publish to "$js.api.stream.info.kv_{bucket}"',  # binding the bucket: refused at its first call
        'publish to "$js.api.consumer.',
        f'subscription to "{cfg.subject_prefix}.>"',
        f'subscription to "$kv.{bucket}.>"',
        'subscription to "_inbox_kvcanary_monitor.>"',
        'subscription to "$js.api.>"',
    ):
        assert any("permissions violation for " + expected in r for r in refused), (expected, refused)


async def _value(bucket: KeyValue, key: str) -> bytes | None:
    """Return ``key``'s value in ``bucket``, or None where it holds none."""
    try:
        return (await bucket.get(key)).value
    except KeyNotFoundError:
        return None


def test_the_taps_credentials_watch_the_quarantine_the_monitors_put_acknowledge_it_and_cannot_write_it(
    permitted_nats: Server, tmp_path: Path
) -> None:
    cfg = permitted_nats.monitor_config()
    keys = make_keys(tmp_path / "keys")
    watch = BucketWatch(permitted_nats.url, TAP_PASSWORD, user="tap", bucket=cfg.quarantine_bucket,
                        keys=keys.public_keys, gateway="gw-1", poll_seconds=0.2)  # fmt: skip

    async def run() -> tuple[list[str], dict[tuple[str, str], int]]:
        monitor = await connect(cfg, MONITOR_PASSWORD, keep_trying=False)
        signer = keys.signer
        publisher = QuarantineBucket(
            cfg, lambda: (monitor.jetstream(timeout=5), monitor.max_payload), lambda: signer
        )
        refused: list[str] = []

        async def note(error: Exception) -> None:
            refused.append(str(error).lower())

        tap = await nats.connect(permitted_nats.tap_url(), error_cb=note, allow_reconnect=False)
        try:
            assert await publisher.publish(document("shared"))
            await until("the tap's watch to read the set", lambda: watch.quarantined(SHARED) is not None)
            # The tap's acknowledgement reaches the monitor: the one subject of its own it publishes on.
            await until("the tap's acknowledgement", lambda: publisher.reads.counts().get(("gw-1", "nats")))
            with pytest.raises(nats.errors.TimeoutError):  # a forged lift: no PubAck comes
                await (await tap.jetstream(timeout=1).key_value(cfg.quarantine_bucket)).put(
                    QUARANTINE_KEY, b"{}"
                )
            await until("the server's refusal", lambda: refused, timeout=10)
            kept = await (await monitor.jetstream(timeout=5).key_value(cfg.quarantine_bucket)).get(
                QUARANTINE_KEY
            )
            assert kept.value is not None and signer.open(kept.value)[1].enforced
            return refused, publisher.reads.counts()
        finally:
            await tap.close()
            await monitor.close()

    try:
        refused, reads = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        watch.close()
    bucket = cfg.quarantine_bucket.lower()
    assert any(f'permissions violation for publish to "$kv.{bucket}.set"' in r for r in refused), refused
    assert not watch.failing and watch.quarantined(SHARED) is not None
    assert reads[("gw-1", "nats")] >= 1
