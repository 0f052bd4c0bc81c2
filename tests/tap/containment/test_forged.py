"""A rogue writer to the quarantine bucket moves no tap, on a real NATS: a monitor replica's publisher
(``monitor/containment/bucket.py``, offered its set every half second as ``kvcanary serve`` does)
and a tap's watch (``kvcanary/tap/containment/bucket.py``), while a plain NATS client with the
rights to write the bucket puts, 20 times a second, each kind for 3 s,

(a) an unsigned set lifting everything at revision 2**53 - 1,
(b) a set signed by another key one revision above the real one, quarantining a healthy target and
    lifting the leaking one,
(c) the monitors' own set from before the quarantine, replayed.

The tap's state is sampled every few milliseconds all along: not once does it route to the
quarantined deployment or away from the healthy one. Both sides count each kind, and say it once;
the replica puts its set back; and a change the monitor then makes reaches the tap within 2 s.
With ``kvcanary serve`` and a real LiteLLM proxy: ``tests/litellm/test_containment_litellm.py``."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from kvcanary.monitor.config.settings import JetStreamConfig
from kvcanary.monitor.containment.bucket import RECHECK_SECONDS, QuarantineBucket
from kvcanary.processes import wait_until
from kvcanary.tap.containment.bucket import BucketWatch
from kvcanary.wire import QUARANTINE_KEY
from tests.support.jetstream import NATS_URL, StreamNames
from tests.support.signing import SHARED, SigningKeys, document, make_keys

HEALTHY = "http://healthy:1"
#: The promise: a change the monitors make reaches every tap within this, forgery or not.
CONTAINMENT_SECONDS = 2.0


class Replica:
    """A monitor replica's publisher on a loop and connection of its own, offered ``set`` every
    half second (``kvcanary serve``'s containment round)."""

    def __init__(self, names: StreamNames, keys: SigningKeys):
        self.cfg = JetStreamConfig.model_validate(names.config())
        signer = keys.signer
        self.bucket = QuarantineBucket(self.cfg, self._connection, lambda: signer)
        self.set: dict[str, Any] = document(revision=1)
        self.client: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def _connection(self) -> Any:
        return (self.client.jetstream(timeout=5), self.client.max_payload) if self.client else None

    async def _run(self) -> None:
        self.client = await nats.connect(NATS_URL)
        while not self._stop.is_set():
            await self.bucket.publish(self.set)
            await asyncio.sleep(0.5)
        await self.client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class Sampler:
    """Reads the tap's set as a request would, every few milliseconds, and keeps what was wrong:
    ``off`` routed to, or ``on`` kept off (api_bases as the gateway spells them)."""

    def __init__(self, watch: BucketWatch, off: str = SHARED, on: str = HEALTHY):
        self.watch, self.off, self.on = watch, off, on
        self.samples = 0
        self.wrong: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.watch.quarantined(self.off) is None:
                self.wrong.append(f"the quarantined deployment routed to ({self.watch.current.revision})")
            if self.watch.quarantined(self.on) is not None:
                self.wrong.append(f"the healthy deployment kept off ({self.watch.current.revision})")
            self.samples += 1
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Rogue:
    """A plain NATS client with the rights to write the bucket, putting ``values`` every 50 ms from a
    thread of its own until :meth:`stop`, which puts ``last`` as its last word: each value in turn,
    or (``hold``) each for that many seconds before the next, long enough for a replica's reading
    of the bucket (every ``RECHECK_SECONDS``) to find each kind."""

    def __init__(self, url: str, bucket: str, values: list[bytes], hold: float = 0.0):
        self.url, self.bucket, self.values, self.hold = url, bucket, values, hold
        self.puts = 0
        self._stop = threading.Event()
        self._last = b""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Rogue:
        self._thread.start()
        return self

    async def _run(self) -> None:
        client = await nats.connect(self.url)
        kv = await client.jetstream(timeout=5).key_value(self.bucket)
        began = time.monotonic()
        while not self._stop.is_set():
            turn = int((time.monotonic() - began) / self.hold) if self.hold else self.puts
            await kv.put(QUARANTINE_KEY, self.values[turn % len(self.values)])
            self.puts += 1
            await asyncio.sleep(0.05)
        await kv.put(QUARANTINE_KEY, self._last)
        self.puts += 1
        await client.close()

    def stop(self, last: bytes) -> int:
        """Stop, the bucket left holding ``last``; return how many values were put."""
        self._last = last
        self._stop.set()
        self._thread.join(10)
        return self.puts


def held(url: str, bucket: str) -> bytes:
    """The bucket's value now, read as any client with the rights to."""

    async def read() -> bytes:
        client = await nats.connect(url)
        kv = await client.jetstream(timeout=5).key_value(bucket)
        value = bytes((await kv.get(QUARANTINE_KEY)).value or b"")
        await client.close()
        return value

    return asyncio.run(read())


@pytest.fixture
def keys(tmp_path: Path) -> SigningKeys:
    return make_keys(tmp_path / "keys")


@pytest.fixture
def replica(stream_names: StreamNames, keys: SigningKeys) -> Iterator[Replica]:
    made = Replica(stream_names, keys)
    yield made
    made.close()


def test_a_rogue_writer_moves_no_tap_for_a_moment_and_the_monitors_next_change_reaches_it(
    replica: Replica,
    stream_names: StreamNames,
    keys: SigningKeys,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    forger = make_keys(tmp_path / "forger")
    watch = BucketWatch(NATS_URL, bucket=stream_names.quarantine_bucket, keys=keys.public_keys,
                        gateway="gw-sampled", poll_seconds=0.2)  # fmt: skip
    sampler: Sampler | None = None
    try:
        wait_until("the first set taken", lambda: watch.current.revision == 1, timeout=10)

        replayed = held(NATS_URL, stream_names.quarantine_bucket)  # the monitors' own, soon superseded
        replica.set = document("shared", revision=2)  # a leak's quarantine
        wait_until("the quarantine taken", lambda: watch.quarantined(SHARED), timeout=10)
        sampler = Sampler(watch)
        forged = [
            json.dumps(document(revision=2**53 - 1)).encode(),  # (a)
            forger.signer.sign(document("healthy", revision=3)),  # (b)
            replayed,  # (c)
        ]
        hold = RECHECK_SECONDS + 1
        rogue = Rogue(NATS_URL, stream_names.quarantine_bucket, forged, hold=hold).start()
        time.sleep(len(forged) * hold)
        puts = rogue.stop(last=forged[0])  # the last word a forgery
        # The monitor's next change, with a forgery in the bucket: an operator's quarantine of another.
        changed = time.monotonic()
        replica.set = document("shared", "other", revision=3)
        wait_until("the change taken", lambda: watch.quarantined("http://other:1"), timeout=10)
        took = time.monotonic() - changed
        sampler.stop()
        print(f"\n{puts} forged values in {len(forged) * hold:.0f} s, {sampler.samples} samples of the tap: "
              f"{len(sampler.wrong)} wrong; the monitor's next change reached the tap {took * 1000:.0f} ms "
              f"after it was made")  # fmt: skip
        assert sampler.wrong == [] and sampler.samples > 500
        assert took < CONTAINMENT_SECONDS
        for reason in ("unsigned", "unknown_key", "older"):
            assert watch.refused[reason] >= 1, watch.refused  # the tap refused each kind
            assert replica.bucket.foreign[reason] >= 1, replica.bucket.foreign  # the replica found each
        assert sum(watch.refused.values()) >= puts - 3  # every value the watch saw (a few may be put over)
        # The replica heard the tap's acknowledgement of the set it applies.
        acknowledged = lambda: replica.bucket.reads.counts().get(("gw-sampled", "nats"))  # noqa: E731
        wait_until("the tap's acknowledgement", acknowledged)
    finally:
        if sampler is not None:
            sampler.stop()
        watch.close()
    said = [r.getMessage() for r in caplog.records]
    assert sum("held a value the monitors did not put" in m for m in said) == 1, said  # once an episode
    refusals = [m for m in said if "refused a quarantine set" in m]
    assert 3 <= len(refusals) <= 3 + 1, refusals  # one line a reason (malformed: none was)
