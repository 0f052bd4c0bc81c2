"""The tap's JetStream sink against real NATS servers: records acknowledged reach the stream, one
message each in their deployment's partition; a NATS that is down, restarts or has no stream costs
one log line while records wait, and nothing is lost or stored twice when it comes back.

The stream is made as the monitor makes it (``monitor/traffic/stream_setup.py``: ``prepare``)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import nats
import pytest

from kvcanary.monitor.traffic import judge
from kvcanary.monitor.traffic.stream_setup import prepare
from kvcanary.processes import wait_until
from kvcanary.tap import Tap, TapConfigError
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.jetstream import MESSAGE_BYTES, JetStreamTransport, partition_of
from kvcanary.tap.record import Exchange, summarize
from kvcanary.tap.sender import Sender
from kvcanary.tap.transport import Batch
from tests.support import REPO, free_port
from tests.support.jetstream import (
    NATS_URL,
    OwnNats,
    StreamNames,
    new_names,
    own_server,
)
from tests.support.pace import PROCESS_SECONDS

pytestmark = pytest.mark.external_service

KEY = b"a-test-fingerprint-key-0123456789"
BASES = [f"http://10.1.0.{i}:8000/v1" for i in range(1, 7)]


def exchange(i: int) -> Exchange:
    text = f"customer {i} asks about the warranty of a charger"
    return Exchange(f"req-{i}", time.time(), f"team-{i % 3}", "team", BASES[i % len(BASES)],
                    prompt=text, response=text)  # fmt: skip


def sender(url: str, names: StreamNames, **kw: Any) -> Sender:
    transport = JetStreamTransport(url, None, partitions=16, subject_prefix=names.subject_prefix)
    return Sender(url, "", Fingerprinter(KEY), gateway="gw-1", flush_seconds=0.05, transport=transport, **kw)


def make_stream(names: StreamNames, url: str = NATS_URL) -> None:
    async def run() -> None:
        client = await nats.connect(url)
        await prepare(client.jetstream(timeout=5), names.settings(url))
        await client.close()

    asyncio.run(run())


Stored = list[tuple[str, dict[str, str], dict[str, Any]]]


def stored_messages(names: StreamNames, url: str = NATS_URL) -> Stored:
    """Every message in the stream: (subject, headers, body)."""

    async def run() -> Stored:
        client = await nats.connect(url)
        js = client.jetstream(timeout=5)
        info = await js.stream_info(names.stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
            msg = await js.get_msg(names.stream, seq)
            out.append((msg.subject, dict(msg.headers or {}), json.loads(msg.data or b"{}")))
        await client.close()
        return out

    return asyncio.run(run())


def stored(names: StreamNames, url: str = NATS_URL) -> Stored:
    """Every record in the stream: (its message's subject, its message's headers, the record)."""
    return [(subject, headers, record) for subject, headers, body in stored_messages(names, url)
            for record in body["records"]]  # fmt: skip


def tap_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvcanary.tap" and r.levelno >= logging.WARNING]


def test_a_batchs_records_reach_the_stream_a_message_for_each_partition_and_a_resend_is_dropped(
    stream_names: StreamNames,
) -> None:
    make_stream(stream_names)
    transport = JetStreamTransport(NATS_URL, None, partitions=16, subject_prefix=stream_names.subject_prefix)
    records = [summarize(exchange(i), Fingerprinter(KEY)) for i in range(30)]
    batch = Batch("ab" * 16, "gw-1", 3, records)
    try:
        assert transport.send(batch) == (30, 0)
        assert transport.send(batch) == (30, 0)  # its acknowledgement lost: sent again, dropped by id
    finally:
        transport.close()
    messages = stored_messages(stream_names)
    partitions = {partition_of(b, 16) for b in BASES}
    assert len(messages) == len(partitions) > 1  # a message for each partition the batch touches
    seen: list[dict[str, Any]] = []
    for subject, headers, body in messages:
        assert headers["Kvcanary-Records"] == str(len(body["records"]))
        assert headers["Kvcanary-Gateway"] == "gw-1" and headers["Nats-Msg-Id"].startswith(batch.id)
        partitions_here = {partition_of(r["api_base"], 16) for r in body["records"]}
        assert {f"{stream_names.subject_prefix}.{p}" for p in partitions_here} == {subject}
        seen += body["records"]
    assert [h.get("Kvcanary-Dropped") for _, h, _ in messages] == ["3"] + [None] * (len(messages) - 1)
    assert sorted(int(r["upstream_id"].split("-")[1]) for r in seen) == list(range(30))  # each record once
    assert "warranty" not in json.dumps(seen)  # sizes and prints, never text


def test_a_partitions_records_past_the_message_bound_go_as_more_messages() -> None:
    transport = JetStreamTransport(NATS_URL, None, partitions=16, subject_prefix="kvctest.bound")
    try:
        big = [{"id": f"r{i}", "api_base": BASES[0], "pad": "x" * 100_000} for i in range(12)]
        messages = transport.messages_of(Batch("cd" * 16, "gw-1", 0, big))
    finally:
        transport.close()
    assert len(messages) == 3 and all(len(payload) <= MESSAGE_BYTES for _, payload, _, _ in messages)
    assert [first for *_, first in messages] == [0, 5, 10]
    assert [json.loads(p)["records"][0]["id"] for _, p, _, _ in messages] == ["r0", "r5", "r10"]
    assert len({h["Nats-Msg-Id"] for _, _, h, _ in messages}) == 3


def test_a_batch_taken_in_part_lets_go_only_of_its_head_before_the_first_refused_message(
    stream_names: StreamNames,
) -> None:
    """Records of a partition the stream lacks are refused (no stream takes the subject): the batch
    is taken up to its first such record; a later partition's message that was acknowledged is
    stored, and goes again with the rest (the monitor judges it once, by its records' ids)."""
    make_stream(stream_names)  # partitions 0 to 15
    transport = JetStreamTransport(NATS_URL, None, partitions=32, subject_prefix=stream_names.subject_prefix)
    bases = [f"http://10.9.0.{i}:8000/v1" for i in range(1, 255)]
    near = next(b for b in bases if partition_of(b, 32) < 16)
    far = next(b for b in bases if partition_of(b, 32) >= 16)
    records = [{"id": f"r{i}", "api_base": base} for i, base in enumerate([near, near, far, near])]
    try:
        assert transport.send(Batch("ef" * 16, "gw-1", 0, records)) == (2, 0)
    finally:
        transport.close()
    assert sorted(r["id"] for _, _, r in stored(stream_names)) == ["r0", "r1", "r3"]


def test_messages_fit_the_servers_max_payload_and_a_record_that_never_can_is_dropped(
    tmp_path: Path, stream_names: StreamNames
) -> None:
    server = next(own_server(tmp_path / "nats-store", max_payload=64 * 1024))
    try:
        server.start()
        make_stream(stream_names, server.url)
        transport = JetStreamTransport(
            server.url, None, partitions=16, subject_prefix=stream_names.subject_prefix
        )
        records = [{"id": f"r{i}", "api_base": BASES[0], "pad": "x" * 20_000} for i in range(10)]
        records.insert(0, {"id": "huge", "api_base": BASES[0], "pad": "x" * 100_000})
        # Under max_payload by itself, over it with its headers: the server would close the connection.
        records.insert(5, {"id": "just-under", "api_base": BASES[0], "pad": "x" * (64 * 1024 - 100)})
        try:
            assert transport.send(Batch("ab" * 16, "gw-1", 5, records)) == (12, 2)
            assert transport.send(Batch("cd" * 16, "gw-1", 0, records[1:3])) == (2, 0)  # connected still
            # A batch with no message to carry its drop report (its one record too large): the
            # report rides with the next message published, added to that batch's own.
            assert transport.send(Batch("ef" * 16, "gw-1", 3, records[:1])) == (1, 1)
            assert transport.send(Batch("12" * 16, "gw-1", 1, records[1:2])) == (1, 0)
        finally:
            transport.close()
        messages = stored_messages(stream_names, server.url)
        assert len(messages) > 3 and all(len(json.dumps(body)) < 64 * 1024 for _, _, body in messages)
        ids = [r["id"] for _, _, body in messages for r in body["records"]]
        assert ids == [f"r{i}" for i in range(10)] + ["r0", "r1", "r0"]  # in order, the too large left out
        # The drop report rides with the first message published, not with the record refused.
        assert messages[0][1].get("Kvcanary-Dropped") == "5"
        assert [m[1].get("Kvcanary-Dropped") for m in messages[-2:]] == [None, "4"]
    finally:
        server.stop()


def test_a_nats_down_at_start_and_restarted_costs_one_line_and_loses_nothing(
    own_nats: OwnNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcanary.tap")
    names = new_names()
    s = sender(own_nats.url, names)
    try:
        wait_until("the tap to say so at start, before any record", lambda: tap_lines(caplog), timeout=10)
        for i in range(20):
            s.put(exchange(i))
        time.sleep(2.0)  # tries on its backoff, each refused
        assert s.sent == 0 and s.pending == 20 and s.dropped == 0  # they wait
        lines = tap_lines(caplog)
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert f"cannot reach NATS at {own_nats.url}" in lines[0].getMessage()
        assert "records wait" in lines[0].getMessage() and lines[0].exc_info is None  # no traceback

        own_nats.start()
        make_stream(names, own_nats.url)
        wait_until("the waiting records to flow", lambda: s.sent == 20, timeout=30)

        own_nats.stop()  # NATS restarts under the tap: what comes meanwhile waits
        for i in range(20, 35):
            s.put(exchange(i))
        time.sleep(1.5)
        assert s.sent == 20 and s.pending == 15
        own_nats.start()
        wait_until("the records of the restart to flow", lambda: s.sent == 35, timeout=40)
        ids = sorted(int(r["upstream_id"].split("-")[1]) for _, _, r in stored(names, own_nats.url))
        assert ids == list(range(35))  # each once: a resend after a lost ack is deduplicated by id
        assert s.dropped == 0
    finally:
        s.close()


def test_no_stream_is_a_wait_said_once_and_records_flow_once_the_monitor_made_it(
    stream_names: StreamNames, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcanary.tap")
    s = sender(NATS_URL, stream_names)
    try:
        for i in range(10):
            s.put(exchange(i))
        time.sleep(2.0)
        assert s.sent == 0 and s.pending == 10
        lines = tap_lines(caplog)
        assert len(lines) == 1 and "no JetStream stream" in lines[0].getMessage(), lines
        make_stream(stream_names)
        wait_until("the records to flow", lambda: s.sent == 10, timeout=20)
        assert len(stored(stream_names)) == 10
    finally:
        s.close()


def test_a_tap_with_more_partitions_than_the_monitor_is_refused_and_says_so(
    stream_names: StreamNames, caplog: pytest.LogCaptureFixture
) -> None:
    """The monitor reads partitions 0 to 15 only: a record the tap puts in partition 20 would wait
    in the stream unjudged, unseen. It is refused instead, and waits in the tap, said once."""
    caplog.set_level(logging.INFO, logger="kvcanary.tap")
    make_stream(stream_names)  # 16 partitions, as the monitor is configured
    bases = (f"http://10.9.0.{i}:8000/v1" for i in range(1, 255))
    base = next(b for b in bases if partition_of(b, 32) >= 16)
    transport = JetStreamTransport(NATS_URL, None, partitions=32, subject_prefix=stream_names.subject_prefix)
    s = Sender(NATS_URL, "", Fingerprinter(KEY), gateway="gw-1", flush_seconds=0.05, transport=transport)
    try:
        s.put(
            Exchange(
                "req-far", time.time(), "team-1", "team", base, prompt="a question", response="an answer"
            )
        )
        wait_until("the tap to say why", lambda: tap_lines(caplog), timeout=10)
        assert (s.sent, s.pending) == (0, 1)
        line = tap_lines(caplog)[0].getMessage()
        assert (
            f"{stream_names.subject_prefix}.{partition_of(base, 32)}" in line
            and "KVCANARY_TAP_PARTITIONS" in line
        )
        assert stored(stream_names) == []
    finally:
        s.close(timeout=1)


def test_past_the_queue_bound_with_nats_away_the_oldest_are_dropped_and_counted() -> None:
    names = new_names()
    dead = f"nats://127.0.0.1:{free_port()}"
    s = sender(dead, names, max_pending=5, batch_records=2)
    try:
        for i in range(12):
            s.put(exchange(i))
        assert s.dropped == 7 and s.pending == 5
    finally:
        s.close(timeout=1)


def test_closing_with_a_publish_in_flight_logs_no_traceback_and_lets_go_of_its_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvcanary.tap")
    with socket.socket() as silent:  # takes connections and never speaks: a NATS that hangs
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        s = sender(url, new_names())
        s.put(exchange(0))
        wait_until("a publish in flight", lambda: s._sending, timeout=10)
        s.close(timeout=0.1)  # shorter than the publish: the transport ends it
        s._thread.join(10)
    assert not s.alive and s.pending == 1  # it waited, untaken
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    transport = s.transport
    assert isinstance(transport, JetStreamTransport) and transport._loop.is_closed()
    s.close(timeout=0.1)  # a second close (a gateway's shutdown hook, then exit) does nothing
    transport.close()


def test_the_tap_partitions_each_deployment_as_the_monitor_routes_it() -> None:
    spellings = [
        "http://10.1.0.1:8000/v1",
        "HTTP://10.1.0.1:8000/V1/",
        "http://10.1.0.1:8000",
        "http://10.1.0.1:8000/",
    ]
    assert len({partition_of(b, 16) for b in spellings}) == 1
    # One rule (kvcanary/wire.py): the tap's partition is the hash of the key the judge routes by.
    for url in [*spellings, "https://Api.Example.com/Prefix/v1", "http://h/a/b/"]:
        assert partition_of(url, 16) == zlib.crc32(judge.api_base_key(url).encode()) % 16


def test_the_tap_imports_without_nats_and_takes_a_nats_url_without_a_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = "import sys, kvcanary.tap; assert 'nats' not in sys.modules, 'nats imported'"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=PROCESS_SECONDS).returncode == 0
    monkeypatch.setenv("KVCANARY_TAP_URL", NATS_URL)
    monkeypatch.delenv("KVCANARY_TAP_TOKEN", raising=False)
    monkeypatch.setenv("KVCANARY_TAP_KEY", KEY.decode())
    monkeypatch.setenv("KVCANARY_TAP_PARTITIONS", "4")
    tap = Tap.from_env()
    try:
        transport = tap.sender.transport
        assert isinstance(transport, JetStreamTransport) and transport.partitions == 4
    finally:
        tap.close(timeout=1)
    # A URL is logged while NATS is away; a token in it would be too.
    monkeypatch.setenv("KVCANARY_TAP_URL", "nats://kvc:s3cret@127.0.0.1:4222")
    with pytest.raises(TapConfigError, match="KVCANARY_TAP_TOKEN") as refused:
        Tap.from_env()
    assert "s3cret" not in str(refused.value)


EXITS_AT_ONCE = """
import time
from kvcanary.tap import Exchange, Tap
tap = Tap.from_env(flush_seconds=30)  # nothing would go out before the exit but for the flush at it
for i in range(5):
    tap.observe(Exchange(f"exit-{i}", time.time(), "team-a", "team", "http://10.1.0.1:8000/v1",
                         prompt="a question", response="an answer"))
"""


def test_a_gateway_that_exits_sends_what_its_tap_still_queues(stream_names: StreamNames) -> None:
    """A gateway's restart (a normal exit after SIGTERM) costs no record: the tap flushes at exit."""
    make_stream(stream_names)
    env = {"KVCANARY_TAP_URL": NATS_URL, "KVCANARY_TAP_KEY": KEY.decode(),
           "KVCANARY_TAP_SUBJECT_PREFIX": stream_names.subject_prefix, "PATH": "/usr/bin:/bin"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", EXITS_AT_ONCE], cwd=REPO, env=env, timeout=PROCESS_SECONDS,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "not sent at exit" not in done.stderr, done.stderr
    assert sorted(r["upstream_id"] for _, _, r in stored(stream_names)) == [f"exit-{i}" for i in range(5)]


@pytest.mark.parametrize("value", ["0", "-1", "61", "soon", "nan"])
def test_a_flush_interval_out_of_range_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVCANARY_TAP_URL", NATS_URL)
    monkeypatch.setenv("KVCANARY_TAP_KEY", KEY.decode())
    monkeypatch.setenv("KVCANARY_TAP_FLUSH_SECONDS", value)
    with pytest.raises(TapConfigError, match="KVCANARY_TAP_FLUSH_SECONDS"):
        Tap.from_env()
    monkeypatch.setenv("KVCANARY_TAP_FLUSH_SECONDS", "0.25")
    tap = Tap.from_env()
    try:
        assert tap.sender.flush_seconds == 0.25
    finally:
        tap.close(timeout=1)


def test_a_forked_child_publishes_its_records_on_a_connection_of_its_own(stream_names: StreamNames) -> None:
    """A gateway forking after its tap connected (gunicorn --preload): the child's tap must not use
    the parent's NATS connection (its socket) or loop thread (not in the child): it connects anew."""
    from tests.tap.test_fork import CHILDREN_SECONDS, fork_child, reap

    make_stream(stream_names)
    s = sender(NATS_URL, stream_names)
    s.put(exchange(0))
    wait_until("the parent's record published", lambda: s.sent == 1)  # connected, its loop thread running

    def child() -> int:
        s.put(exchange(1))
        s.put(exchange(2))
        s.close(10.0)  # publishes what the child queued
        return 0 if (s.sent, s.pending) == (2, 0) else 1

    statuses = reap([fork_child(child)], CHILDREN_SECONDS)
    s.put(exchange(3))  # the parent's connection still works after the child closed its tap
    wait_until("the parent's second record published", lambda: s.sent == 2)
    s.close()
    assert list(statuses.values()) == [0]
    ids = sorted(r["upstream_id"] for _, _, r in stored(stream_names))
    assert ids == ["req-0", "req-1", "req-2", "req-3"]
