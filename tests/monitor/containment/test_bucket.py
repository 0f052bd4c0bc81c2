"""The monitor's side of the quarantine bucket (``monitor/containment/bucket.py``) on a real
NATS: a set is put signed, only when it changed (its times aside) or is due for renewal, never
over a newer one; a lost value is put right within ``RECHECK_SECONDS``; a value the monitors did
not put (unsigned, another key's, tampered, an older set of theirs put back) is counted by reason,
said once, and replaced by their set; a round without NATS is said once and put at the next round
that has it; and the taps' acknowledgements count as reads by their gateway. The taps' side:
``tests/tap/containment/test_bucket.py``; a rogue writer against both: ``test_forged.py`` there."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest

from kvcanary.monitor.config.settings import ContainmentSigningConfig
from kvcanary.monitor.containment.bucket import RECHECK_SECONDS
from kvcanary.processes import wait_until
from kvcanary.wire import applied_subject
from tests.support.jetstream import NATS_URL, StreamNames
from tests.support.signing import SigningKeys, document, make_keys
from tests.tap.containment.test_bucket import Monitor


@pytest.fixture
def keys(tmp_path: Path) -> SigningKeys:
    return make_keys(tmp_path / "keys")


@pytest.fixture
def monitor(stream_names: StreamNames, keys: SigningKeys) -> Iterator[Monitor]:
    found = Monitor(stream_names, keys).connect()
    yield found
    found.close()


def payload(monitor: Monitor) -> dict[str, Any]:
    """The set the bucket holds, opened with the monitor's keys (raises if it is not theirs)."""
    return monitor.signer.open(monitor.held())[0]


def test_the_monitor_puts_a_signed_set_only_when_it_changed(monitor: Monitor, keys: SigningKeys) -> None:
    assert monitor.publish(document("shared"))
    first = monitor.revision()
    envelope = json.loads(monitor.held())
    assert [s["keyid"] for s in envelope["signatures"]] == [keys.key_id]
    held = json.loads(base64.b64decode(envelope["payload"]))
    assert held["version"] == 2 and held["deployments"][0]["target"] == "shared"
    assert datetime.fromisoformat(held["expires_at"]) - datetime.fromisoformat(held["generated_at"]) == (
        timedelta(seconds=3600)
    )
    time.sleep(0.01)
    assert monitor.publish(document("shared"))  # only its times differ: nothing put
    assert monitor.revision() == first and monitor.bucket.puts == 1
    assert monitor.publish(document("shared", incident=43))
    assert monitor.revision() > first and monitor.bucket.puts == 2
    assert monitor.bucket.foreign.total() == 0


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


def test_without_a_key_nothing_is_put(monitor: Monitor) -> None:
    monitor.signer = None  # type: ignore[assignment]  # a monitor whose settings need no key, and have none
    assert not monitor.publish(document("shared")) and monitor.bucket.puts == 0


def test_an_older_set_never_replaces_a_newer_one_and_a_lost_one_is_put_again(
    monitor: Monitor, stream_names: StreamNames, keys: SigningKeys
) -> None:
    ahead = Monitor(stream_names, keys).connect()  # a second replica, which read the rows later
    try:
        assert ahead.publish(document("shared", revision=7))
        assert monitor.publish(document(revision=6))  # read before the change: left for 7
        assert monitor.bucket.puts == 0 and payload(monitor)["revision"] == 7
        assert monitor.publish(document("shared", revision=7))  # caught up: the same set, not put
        assert monitor.bucket.puts == 0
        monitor.put_raw(b"")  # the value lost (deleted by hand, a bucket restored empty)
        monitor.now += RECHECK_SECONDS / 2
        assert monitor.publish(document("shared", revision=7)) and monitor.held() == b""  # not due yet
        monitor.now += RECHECK_SECONDS
        assert monitor.publish(document("shared", revision=7))  # read again: put right
        assert monitor.bucket.puts == 1 and payload(monitor)["deployments"]
        assert monitor.bucket.foreign.total() == 0  # a lost value is not a forged one
    finally:
        ahead.close()


def test_a_set_put_is_generated_after_the_one_it_replaces_whatever_the_replicas_clocks_say(
    monitor: Monitor, stream_names: StreamNames, keys: SigningKeys
) -> None:
    """A replica whose clock runs an hour ahead puts a set; one with the right clock puts the next:
    its set must still be newer to a tap, or every tap would refuse it as older."""
    ahead = Monitor(stream_names, keys).connect()
    try:
        assert ahead.publish(document("shared", revision=3))
        future = datetime.now(UTC) + timedelta(hours=1)
        forged_clock = keys.signer.sign(document("shared", revision=3, generated=future))
        ahead.put_raw(forged_clock)  # what that replica's clock made
        assert monitor.publish(document("shared", "other", revision=4))
        held = payload(monitor)
        assert held["revision"] == 4 and datetime.fromisoformat(held["generated_at"]) > future
    finally:
        ahead.close()


def test_a_set_is_signed_anew_before_it_expires_though_nothing_changed(
    stream_names: StreamNames, keys: SigningKeys
) -> None:
    # Renewal is by the wall clock: 3 s leaves a loaded machine room for the first check's NATS read.
    signing = ContainmentSigningConfig(renew_seconds=3, expires_seconds=30)
    monitor = Monitor(stream_names, keys, signing=signing).connect()
    try:
        assert monitor.publish(document("shared"))
        first = payload(monitor)["generated_at"]
        monitor.now += RECHECK_SECONDS
        assert monitor.publish(document("shared")) and monitor.bucket.puts == 1  # not due yet
        time.sleep(3.1)
        monitor.now += RECHECK_SECONDS
        assert monitor.publish(document("shared")) and monitor.bucket.puts == 2
        renewed = payload(monitor)
        assert renewed["generated_at"] > first and renewed["deployments"][0]["target"] == "shared"
    finally:
        monitor.close()


def test_values_the_monitors_did_not_put_are_counted_said_once_and_replaced(
    monitor: Monitor, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    forger = make_keys(tmp_path / "forger")
    assert monitor.publish(document("shared", revision=5))
    old = monitor.held()
    assert monitor.publish(document("shared", "other", revision=6))
    envelope = json.loads(monitor.held())
    tampered = {**envelope, "payload": base64.b64encode(json.dumps(document(revision=6)).encode()).decode()}
    rogue_values = {
        "unsigned": json.dumps(document(revision=2**53 - 1)).encode(),
        "unknown_key": forger.signer.sign(document("other", revision=7)),
        "bad_signature": json.dumps(tampered).encode(),
        "malformed": b"\x00 not a set",
        "older": old,  # a set the monitors signed, put back after a newer one
    }
    with caplog.at_level(logging.WARNING, "kvcanary.containment"):
        for reason, value in rogue_values.items():
            monitor.put_raw(value)
            monitor.now += RECHECK_SECONDS
            assert monitor.publish(document("shared", "other", revision=6)), reason
            held = payload(monitor)
            assert held["revision"] == 6 and len(held["deployments"]) == 2, reason
            assert monitor.bucket.foreign[reason] == 1, (reason, monitor.bucket.foreign)
        monitor.now += RECHECK_SECONDS
        assert monitor.publish(document("shared", "other", revision=6))  # its own: nothing more counted
    assert sum(monitor.bucket.foreign.values()) == len(rogue_values)
    said = [r.getMessage() for r in caplog.records if "did not put" in r.getMessage()]
    assert len(said) == 1 and "unsigned" in said[0], said  # one line an episode


def test_the_taps_acknowledgements_count_as_reads_by_their_gateway(
    monitor: Monitor, stream_names: StreamNames, keys: SigningKeys
) -> None:
    assert monitor.publish(document("shared"))  # the replica listens from its first put

    async def acknowledge() -> None:
        client = await nats.connect(NATS_URL)
        for gateway, revision in (("gw-a", 1), ("gw-a", 1), ("gw.b:2", 9), ("g" * 65, "12")):
            said = json.dumps({"revision": revision, "key_id": keys.key_id}).encode()
            await client.publish(applied_subject(stream_names.quarantine_bucket, gateway), said)
        await client.flush()
        await client.close()

    asyncio.run(acknowledge())

    def heard() -> bool:
        monitor.loop.run_until_complete(asyncio.sleep(0.05))  # the replica's loop delivers them
        return sum(monitor.bucket.reads.counts().values()) == 4

    wait_until("the acknowledgements heard", heard)
    assert monitor.bucket.reads.counts() == {
        ("gw-a", "nats"): 2, ("gw.b:2", "nats"): 1, ("(unnamed)", "nats"): 1
    }  # fmt: skip
    last = monitor.bucket.reads.last()
    assert set(last) == {("gw-a", keys.key_id), ("gw.b:2", keys.key_id), ("(unnamed)", keys.key_id)}
    assert all(time.time() - at < 30 for at in last.values())
    assert monitor.bucket.reads.held_newest == 9  # the highest a gateway said it holds ("12" is no revision)
