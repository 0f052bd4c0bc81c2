"""Processes on loopback, as the demo, the tests and the benchmarks start them: a free port, waiting
for a condition (a process's URL to answer, a count to be reached), and stopping process groups
(one grace for all, then SIGKILL).

One module for all three, so that a fix of how a server is waited for or stopped reaches every
place that starts one.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")

#: Where a listening port is drawn from when the kernel's ephemeral range cannot be read.
LISTEN_PORTS = range(20000, 32768)
#: Draws before falling back to a port the kernel picks.
PORT_DRAWS = 64


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now, outside the kernel's ephemeral range.

    A port the kernel picks for ``bind(0)`` comes from the range it also gives outgoing connections
    their local ports from: between this call and the server's own bind, any of the thousands of
    client connections a test run opens may take it ("Address already in use", seen in CI). A port
    below that range is only ever taken by a listener, so the window closes to the few servers that
    draw at the same moment."""
    low, _ = _ephemeral_range()
    ports = range(LISTEN_PORTS.start, min(LISTEN_PORTS.stop, low)) or LISTEN_PORTS
    for _ in range(PORT_DRAWS):
        port = random.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    """Return the kernel's range of local ports for outgoing connections (Linux; else the IANA one)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def wait_until(
    what: str,
    check: Callable[[], T],
    timeout: float = 30.0,
    *,
    every: float = 0.05,
    alive: Callable[[], str | None] | None = None,
    state: Callable[[], str] | None = None,
) -> T:
    """Return ``check()``'s value once it is true. Raise RuntimeError as soon as ``alive()`` says
    why what is waited on cannot come any more (a process that exited), TimeoutError after
    ``timeout`` seconds naming ``what`` (and ``state()``, where given)."""
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None and (gone := alive()) is not None:
            raise RuntimeError(f"{gone} before {what}")
        if value := check():
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(every)
    said = f": {state()}" if state is not None else ""
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{said}")


def wait_http(
    url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None, *, every: float = 0.1
) -> None:
    """Return once ``url`` answers 200. Raise RuntimeError as soon as ``proc`` (the process serving
    it) has exited, TimeoutError after ``timeout`` seconds, each saying why."""
    last = ["no answer"]

    def answers() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError as exc:
            last[0] = str(exc) or type(exc).__name__
            return False

    def exited() -> str | None:
        if proc is None or proc.poll() is None:
            return None
        name = proc.args[0] if isinstance(proc.args, list) else proc.args
        return f"{name!s} exited with {proc.returncode}"

    wait_until(f"{url} to be ready", answers, timeout, every=every, alive=exited, state=lambda: last[0])


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    """Stop every process group at once (each started with ``start_new_session=True``): SIGTERM to
    all, then SIGKILL to those still there after ``timeout`` seconds, so that stopping five takes
    one grace at most, not five."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Stop ``proc``'s process group: SIGTERM, then SIGKILL after ``timeout`` seconds."""
    stop_processes([proc], timeout)
