"""Fixtures for probe tests: the reference worker as a real process (see ``probe_harness``).

- ``reference(*args)`` starts a fresh ``python -m kvcanary.workers`` through ``start_worker``, for scenes
  whose outcome depends on what the worker's KV pages hold (stale-page leaks).
- ``shared_reference(mode)`` returns a worker started once per session, for checks that do not
  depend on page history (a clean worker passes whatever ran on it before).
- ``unreachable`` is a loopback address where nothing listens.

Every worker gets one API key per test tenant.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.probes.probe_harness import SHARED, Reference
from tests.support import REPO, free_port, stop_process, wait_http
from tests.support.worker_keys import KEY_FLAGS


@pytest.fixture
def reference(start_worker: Callable[..., Any]) -> Callable[..., Reference]:
    """Start a fresh reference worker with ARGS (plus the tenants' keys); stopped after the test."""

    def start(*args: str) -> Reference:
        return Reference(start_worker(*args, *KEY_FLAGS).url)

    return start


@pytest.fixture(scope="session")
def shared_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Reference]]:
    """Return a worker per ``SHARED`` mode, started on first use and stopped at the end of the session."""
    started: dict[str, tuple[subprocess.Popen[bytes], Reference]] = {}

    def get(mode: str) -> Reference:
        if mode not in started:
            port = free_port()
            log = tmp_path_factory.mktemp("worker") / f"worker-{port}.log"
            argv = [sys.executable, "-m", "kvcanary.workers", "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--device", "cpu", *SHARED[mode], *KEY_FLAGS]
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
                )
            started[mode] = (proc, Reference(f"http://127.0.0.1:{port}"))
            try:
                wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc)
            except Exception as exc:
                raise RuntimeError(f"worker {mode} did not start: {exc}\n{log.read_text()}") from exc
        return started[mode][1]

    yield get
    for proc, _ in started.values():
        stop_process(proc)


@pytest.fixture
def unreachable() -> Reference:
    """An address on loopback where nothing listens: every request is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return Reference(f"http://127.0.0.1:{port}")
