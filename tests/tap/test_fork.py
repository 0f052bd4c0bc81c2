"""A gateway that forks after its tap is built (gunicorn ``--preload``, multiprocessing): children
forked with real ``os.fork()``, the tap posting to a monitor on a real loopback socket."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from kvcanary.tap import Tap
from kvcanary.tap.record import Exchange
from tests.tap.receiver import Monitor, wait_until

KEY = b"a-test-fingerprint-key-0123456789"
#: How long every child together may take to observe and exit. A hung child hangs for ever, so
#: the bound is generous: a loaded machine's scheduling never comes near it.
CHILDREN_SECONDS = 20.0


def exchange(request_id: str) -> Exchange:
    text = "a customer asks about the warranty of a charger bought last spring"
    return Exchange(
        request_id, time.time(), "acme", "team", "http://127.0.0.1:1/v1", prompt=text, response=text
    )


def fork_child(body: Callable[[], int]) -> int:
    """Fork; the child runs ``body`` and exits with its status (2 if it raised), never returning
    into pytest. Return the child's pid."""
    pid = os.fork()
    if pid == 0:
        status = 2
        try:
            status = body()
        finally:
            os._exit(status)
    return pid


def observed(tap: Tap, ex: Exchange) -> int:
    """Observe ``ex``; return 0, a child's exit status once observe() returned."""
    tap.observe(ex)
    return 0


def reap(pids: list[int], timeout: float) -> dict[int, int | None]:
    """Return each child's exit status, None for one still running after ``timeout`` (then killed)."""
    statuses: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout
    while len(statuses) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for pid in pids:
        if pid not in statuses:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            statuses[pid] = None
    return statuses


def test_children_forked_while_the_tap_is_busy_return_from_observe(monitor: Monitor) -> None:
    """Another thread observes without pause while the parent forks: a child forked while that
    thread (or the tap's own) held the tap's lock hung in its first observe() for good."""
    tap = Tap(monitor.server.url, "tok", KEY, gateway="gw", flush_seconds=0.05)
    stop = threading.Event()

    def hammer() -> None:
        i = 0
        while not stop.is_set():
            tap.observe(exchange(f"parent-{i}"))
            i += 1

    busy = threading.Thread(target=hammer, daemon=True)
    busy.start()
    pids = []
    try:
        for n in range(20):
            time.sleep(0.02)  # the busy thread runs between forks
            pids.append(fork_child(lambda n=n: observed(tap, exchange(f"child-{n}"))))  # type: ignore[misc]
    finally:
        stop.set()
        busy.join()
    statuses = reap(pids, CHILDREN_SECONDS)
    hung = sum(status is None for status in statuses.values())
    assert hung == 0, f"{hung} of 20 children hung in observe()"
    assert set(statuses.values()) == {0}
    tap.close()


def test_a_child_forked_while_idle_sends_its_own_records_and_never_the_parents(monitor: Monitor) -> None:
    """The child's tap starts its own thread on its first observe and posts what the child saw; the
    records queued in the parent at the fork are the parent's to send, once."""
    tap = Tap(monitor.server.url, "tok", KEY, gateway="gw", flush_seconds=0.05)
    tap.observe(exchange("parent-sent"))
    wait_until(lambda: tap.stats()["sent"] == 1)  # the tap's thread is idle now
    tap.sender.flush_seconds = 1.0  # two records wait in the parent's queue at the fork
    tap.observe(exchange("parent-queued-0"))
    tap.observe(exchange("parent-queued-1"))

    def child() -> int:
        tap.observe(exchange("child-0"))
        tap.observe(exchange("child-1"))
        tap.close(10.0)  # sends what the child queued
        return 0 if tap.stats() == {"sent": 2, "dropped": 0, "rejected": 0, "pending": 0} else 1

    statuses = reap([fork_child(child)], CHILDREN_SECONDS)
    tap.close(10.0)
    assert list(statuses.values()) == [0]
    assert sorted(monitor.records()) == [
        "child-0", "child-1", "parent-queued-0", "parent-queued-1", "parent-sent",
    ]  # fmt: skip
    gateways = {body["gateway"] for body in monitor.bodies}
    assert gateways == {"gw"}
