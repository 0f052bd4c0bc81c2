"""The monitor's side of the quarantine bucket (``monitor/containment/bucket.py``) on a real
NATS: a set is put only when it changed (``generated_at`` aside), never over a newer one, a lost or
unreadable value is put right within ``RECHECK_SECONDS``, and a round without NATS is said once and
put at the next round that has it. The taps' side: ``tests/tap/containment/test_bucket.py``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from kvcanary.monitor.containment.bucket import RECHECK_SECONDS
from kvcanary.wire import QUARANTINE_KEY
from tests.support.jetstream import StreamNames
from tests.tap.containment.test_bucket import Monitor, document


@pytest.fixture
def monitor(stream_names: StreamNames) -> Iterator[Monitor]:
    found = Monitor(stream_names).connect()
    yield found
    found.close()


def test_the_monitor_puts_only_a_set_that_changed(monitor: Monitor) -> None:
    assert monitor.publish(document("shared"))
    first = monitor.revision()
    time.sleep(0.01)
    assert monitor.publish(document("shared"))  # only generated_at differs: nothing put
    assert monitor.revision() == first and monitor.bucket.puts == 1
    assert monitor.publish(document("shared", incident=43))
    assert monitor.revision() > first and monitor.bucket.puts == 2


def test_a_round_without_nats_is_said_once_and_the_set_put_when_it_is_back(
    monitor: Monitor, caplog: pytest.LogCaptureFixture
) -> None:
    client, monitor.client = monitor.client, None  # the replica's connection is down
    with caplog.at_level(logging.WARNING, "kvcanary.containment"):
        assert not monitor.publish(document("shared"))
        assert not monitor.publish(document("shared"))
        monitor.client = client
        assert monitor.publish(document("shared")) and monitor.bucket.puts == 1
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "cannot put it" in m]) == 1 and any("again" in m for m in said), said


def test_an_older_set_never_replaces_a_newer_one_and_a_lost_one_is_put_again(
    monitor: Monitor, stream_names: StreamNames
) -> None:
    ahead = Monitor(stream_names).connect()  # a second replica, which read the rows later
    try:
        assert ahead.publish(document("shared", revision=7))
        assert monitor.publish(document(revision=6))  # read before the change: left for 7
        assert monitor.bucket.puts == 0 and b"shared" in held(monitor)
        assert monitor.publish(document("shared", revision=7))  # caught up: the same set, not put
        assert monitor.bucket.puts == 0
        monitor.put_raw(b"")  # the value lost (deleted by hand, a bucket restored empty)
        monitor.now += RECHECK_SECONDS / 2
        assert monitor.publish(document("shared", revision=7)) and held(monitor) == b""  # not due yet
        monitor.now += RECHECK_SECONDS
        assert monitor.publish(document("shared", revision=7))  # read again: put right
        assert monitor.bucket.puts == 1 and b"shared" in held(monitor)
    finally:
        ahead.close()


def held(monitor: Monitor) -> bytes:
    async def read() -> bytes:
        kv = await monitor.client.jetstream(timeout=5).key_value(monitor.cfg.quarantine_bucket)
        return bytes((await kv.get(QUARANTINE_KEY)).value or b"")

    return monitor.loop.run_until_complete(read())
