"""The tap's sender against a monitor on a real loopback socket, scripted where the real monitor
cannot misbehave on cue (down, 503, redirecting, refusing some records, answering garbage)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx

from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange
from kvcanary.tap.sender import Sender
from kvcanary.wire import MAX_DROPPED
from tests.tap.receiver import Monitor, wait_until

KEY = b"a-test-fingerprint-key-0123456789"


def exchange(i: int, text: str = "a customer asks about the warranty of a charger") -> Exchange:
    return Exchange(f"r{i}", time.time(), "acme", "team", "http://127.0.0.1:1/v1", prompt=text, response=text)


def sender(url: str, **kw: object) -> Sender:
    return Sender(url, "tok", Fingerprinter(KEY), gateway="gw", **kw)  # type: ignore[arg-type]


def test_records_go_in_batches_and_a_waiting_record_costs_no_cpu(monitor: Monitor) -> None:
    s = sender(monitor.server.url, flush_seconds=1.0, batch_records=3)
    for i in range(3):
        s.put(exchange(i))
    wait_until(lambda: monitor.records() == ["r0", "r1", "r2"])
    s.put(exchange(3))  # alone, below a batch: it waits out flush_seconds
    start = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - start < 0.1  # the thread sleeps; it does not spin
    # The sender counts a batch sent once the monitor's answer is back, just after it was stored.
    wait_until(lambda: "r3" in monitor.records() and s.sent == 4)
    assert len(monitor.bodies) == 2
    s.close()


def test_a_monitor_that_is_down_costs_nothing_and_gets_what_waited(monitor: Monitor) -> None:
    monitor.answer = lambda body: httpx.Response(503)
    s = sender(monitor.server.url, flush_seconds=0.05)
    start = time.perf_counter()
    for i in range(50):
        s.put(exchange(i))
    assert time.perf_counter() - start < 0.5  # put() returns at once (the network's timeout is 5 s)
    wait_until(lambda: len(monitor.bodies) >= 2)  # refused, and tried again
    retried = {b["batch"] for b in monitor.bodies}
    monitor.answer = lambda body: httpx.Response(200, json={})
    wait_until(lambda: s.sent == 50)
    assert len(retried) == 1  # the same batch, under the same id, each time
    assert sorted(set(monitor.records()), key=lambda r: int(r[1:])) == [f"r{i}" for i in range(50)]
    s.close()


def test_customer_requests_do_not_cut_the_backoff_short(monitor: Monitor) -> None:
    """A monitor that is down (or refuses the token) gets one post per backoff step, not one per
    customer request: each post serializes the batch again, in the gateway."""
    monitor.answer = lambda body: httpx.Response(503)
    s = sender(monitor.server.url, flush_seconds=0.05)
    for i in range(150):  # 100 requests a second for 1.5 s
        s.put(exchange(i))
        time.sleep(0.01)
    posts = len(monitor.bodies)
    assert 1 <= posts <= 4, posts  # tries at 0, +0.5 s and +1.5 s (+ one at the edge)
    monitor.answer = lambda body: httpx.Response(200, json={})
    wait_until(lambda: s.sent == 150, timeout=20)
    s.close()


def test_past_its_bound_the_oldest_waiting_are_dropped_counted_and_reported(monitor: Monitor) -> None:
    monitor.answer = lambda body: httpx.Response(503)
    s = sender(monitor.server.url, flush_seconds=0.05, max_pending=5, batch_records=2)
    for i in range(12):
        s.put(exchange(i))
    assert s.dropped == 7 and s.pending == 5
    monitor.answer = lambda body: httpx.Response(200, json={})
    wait_until(lambda: s.pending == 0)
    got = monitor.records()
    # The newest kept, the oldest waiting gone; what the tap's thread held (an exchange being
    # summarized, or a batch of up to batch_records=2 being posted, when the bound was met) is
    # never dropped, whichever it was: r0 and r1 in one full run of the suite.
    older = [r for r in set(got) if int(r[1:]) < 8]
    assert "r11" in got and len(older) <= 2, got
    assert s.sent + s.dropped == 12 + len(got) - len(set(got))  # nothing counted twice
    reported = {b["batch"]: int(b["dropped"]) for b in monitor.bodies}  # a batch says the same each try
    assert sum(reported.values()) == 7  # every drop reported, once
    s.close()


def test_a_drop_count_past_what_a_batch_may_report_rides_with_the_next_batches(monitor: Monitor) -> None:
    # The monitor refuses a batch reporting more than MAX_DROPPED (one input must not move its
    # counter further); a tap that dropped more reports it over several batches, all of it taken.
    s = sender(monitor.server.url, flush_seconds=0.05, batch_records=1)
    s._count_drop(2 * MAX_DROPPED + 5)  # as a long outage would have
    for i in range(3):
        s.put(exchange(i))
    wait_until(lambda: s.sent == 3)
    assert [int(b["dropped"]) for b in monitor.bodies] == [MAX_DROPPED, MAX_DROPPED, 5]
    s.close()


def test_past_its_byte_bound_the_oldest_waiting_are_dropped(monitor: Monitor) -> None:
    """Few but huge exchanges: the queue is bounded by what it holds, not only by its length."""
    monitor.answer = lambda body: httpx.Response(503)
    big = "word " * 20_000  # 100 KB a text: cut to 64 KB each side
    s = sender(monitor.server.url, flush_seconds=0.05, max_pending_bytes=1_000_000)
    for i in range(40):
        s.put(exchange(i, big))
    assert s.dropped > 20 and s.pending < 40 and s.pending_bytes <= 1_000_000
    monitor.answer = lambda body: httpx.Response(200, json={})
    wait_until(lambda: s.pending == 0)
    assert "r39" in monitor.records() and s.pending_bytes == 0  # the newest kept; all accounted
    s.close()


def test_refused_records_are_counted_and_not_sent_again(monitor: Monitor) -> None:
    monitor.answer = lambda body: httpx.Response(422, json={"detail": [], "rejected": 1})
    s = sender(monitor.server.url, flush_seconds=0.05)
    for i in range(3):
        s.put(exchange(i))
    wait_until(lambda: s.rejected == 1)
    time.sleep(0.3)
    assert len(monitor.bodies) == 1 and s.sent == 2 and s.dropped == 1
    s.close()


def test_a_redirect_is_not_followed_and_the_records_wait(monitor: Monitor) -> None:
    monitor.answer = lambda body: httpx.Response(302, headers={"Location": monitor.server.url + "/elsewhere"})
    s = sender(monitor.server.url, flush_seconds=0.05)
    s.put(exchange(1))
    wait_until(lambda: len(monitor.bodies) >= 2)  # tried again: the record waits, the thread lives
    assert s.alive and s.sent == 0 and s.pending == 1
    monitor.answer = lambda body: httpx.Response(200, json={})
    wait_until(lambda: s.sent == 1)
    s.close()


def test_an_answer_that_is_not_http_leaves_the_thread_alive() -> None:
    """A URL pointing at something that is no HTTP server (http.client's BadStatusLine, which is no
    OSError): the record waits and the thread lives."""
    listener = socket.create_server(("127.0.0.1", 0))
    tries: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            conn.close()
            tries.append(1)

    threading.Thread(target=serve, daemon=True).start()
    s = sender(f"http://127.0.0.1:{listener.getsockname()[1]}", flush_seconds=0.05)
    s.put(exchange(1))
    wait_until(lambda: len(tries) >= 2)
    assert s.alive and s.pending == 1 and s.sent == 0
    s.close(timeout=0.1)
    listener.close()


def test_an_unreachable_monitor_is_tried_again_and_the_thread_lives() -> None:
    s = sender("http://127.0.0.1:9", flush_seconds=0.05, timeout_seconds=0.5)
    s.put(exchange(1))
    time.sleep(0.8)
    assert s.alive and s.pending == 1 and s.sent == 0
    s.close(timeout=0.1)


def refusing_over(monitor: Monitor, limit: int) -> None:
    """Script ``monitor`` as a proxy in front of it with a body cap of ``limit`` bytes would answer."""

    def answer(body: dict[str, Any]) -> httpx.Response:
        if monitor.sizes[-1] > limit:
            return httpx.Response(413, json={"detail": f"body: over {limit} bytes"})
        return httpx.Response(200, json={"accepted": len(body["records"])})

    monitor.answer = answer


def test_a_batch_refused_as_too_large_is_sent_in_halves_and_a_record_too_large_alone_is_dropped(
    monitor: Monitor,
) -> None:
    text = " ".join(f"word{i}" for i in range(600))  # about 150 prints a side: 5 KB a record
    big = " ".join(f"other{i}" for i in range(8000))  # every print a side allows: 35 KB, over the cap
    cap = 20_000
    refusing_over(monitor, cap)
    s = sender(monitor.server.url, flush_seconds=0.2, batch_records=20)
    s._count_drop(3)  # as an outage would have: reported with the first part taken
    for i in range(20):
        s.put(exchange(i, big if i == 7 else text))
    wait_until(lambda: s.pending == 0, timeout=30)
    taken = [b for b, size in zip(monitor.bodies, monitor.sizes, strict=True) if size <= cap]
    got = [r["upstream_id"] for b in taken for r in b["records"]]
    assert sorted(got, key=lambda r: int(r[1:])) == [f"r{i}" for i in range(20) if i != 7]  # each once
    assert s.sent == 19 and s.rejected == 1 and s.dropped == 4  # the record alone too large, and the 3
    assert len({b["batch"] for b in monitor.bodies}) == len(monitor.bodies)  # a part: an id of its own
    assert [int(b["dropped"]) for b in taken] == [3] + [0] * (len(taken) - 1)  # reported once, first
    # The size refused is remembered: a second batch as large is split before it is posted.
    refused = len(monitor.bodies) - len(taken)
    for i in range(20, 40):
        s.put(exchange(i, text))
    wait_until(lambda: s.sent == 39, timeout=30)
    assert len(monitor.bodies) - len([n for n in monitor.sizes if n <= cap]) == refused
    s.close()
