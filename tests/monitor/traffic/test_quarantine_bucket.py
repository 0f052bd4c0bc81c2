"""The monitor's side of the quarantine bucket (``monitor/traffic/quarantine_bucket.py``) on a real
NATS: a set is put only when it changed (``generated_at`` aside), and a round without NATS is said
once and put at the next round that has it. The taps' side: ``tests/tap/test_quarantine_bucket.py``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from tests.support.jetstream import StreamNames
from tests.tap.test_quarantine_bucket import Monitor, document


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
