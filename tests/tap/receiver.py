"""A monitor's ingest on a real loopback socket, scripted where the real monitor cannot misbehave on
cue (down, 503, redirecting, refusing some records, answering garbage); every body is kept."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx

from kvcanary import processes
from tests.support.loopback import Loopback


class Monitor:
    """A scripted monitor: ``answer`` says what the next posts get; every body is kept."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.sizes: list[int] = []  # each body's bytes, beside ``bodies``
        self.answer: Callable[[dict[str, Any]], httpx.Response] = lambda body: httpx.Response(
            200, json={"accepted": len(body["records"])}
        )
        self.lock = threading.Lock()
        self.server = Loopback(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with self.lock:
            self.bodies.append(body)
            self.sizes.append(len(request.content))
        return self.answer(body)

    def records(self) -> list[str]:
        """Return the gateway id (``upstream_id``) of every record posted, in order (resends included)."""
        return [r["upstream_id"] for r in self.posted()]

    def posted(self) -> list[dict[str, Any]]:
        """Return every record posted, in the order they came (resends included)."""
        with self.lock:
            return [r for b in self.bodies for r in b["records"]]


def wait_until(check: Callable[[], object], timeout: float = 10) -> None:
    """Return once ``check()`` is true; raise TimeoutError after ``timeout`` seconds."""
    processes.wait_until("the receiver's condition", check, timeout, every=0.02)
