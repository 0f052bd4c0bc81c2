"""How a demo stops on Ctrl-C (SIGINT) or SIGTERM: in order, with its closing line, its processes
with it.

uvicorn takes both signals while it serves and raises them again once it has shut down. Left to
``asyncio.run``'s own SIGINT handler, that second Ctrl-C becomes a ``KeyboardInterrupt`` thrown
into whichever task runs (a traceback from starlette's lifespan, and no closing line); a
``SystemExit`` raised there can land in a task that swallows it (uvicorn's lifespan startup does)
and the demo runs on. So the demo's own handler, installed before either, only notes the signal
while the loop runs: the demo's watcher stops the server and the demo ends in order. Outside the
loop (while its processes start) it exits at once, the caller's ``finally`` stopping them. The
demo's server (:class:`DemoServer`) notes the signals uvicorn takes too, so that whatever the loop
is stuck on, the shutdown included, a watchdog ends the demo and its processes within a grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from kvcanary.monitor.config.settings import Settings
from kvcanary.processes import stop_processes

#: Seconds a demo asked to stop may take to stop in order before the watchdog stops it.
GRACE_SECONDS = 20.0


class DemoStop:
    """The signal that asked the demo to stop, if any, and the processes to stop with it."""

    def __init__(self, grace_seconds: float = GRACE_SECONDS) -> None:
        self.signum: int | None = None
        self.children: list[subprocess.Popen[bytes]] = []
        self.grace_seconds = grace_seconds

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.note)

    @property
    def asked(self) -> bool:
        return self.signum is not None

    def exit_if_terminated(self) -> None:
        """A SIGTERM'd demo exits 143 (the service manager's stop); a Ctrl-C'd one closes as usual."""
        if self.signum == signal.SIGTERM:
            raise SystemExit(128 + signal.SIGTERM)

    def note(self, signum: int, frame: object = None) -> None:
        """Take a stop signal: in the loop, note it (the watchdog starts); outside it, exit now."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise SystemExit(128 + signum) from None
        if self.signum is None:
            watch = threading.Thread(
                target=self._watchdog, args=(signum, loop), name="demo-stop", daemon=True
            )
            watch.start()
        self.signum = signum

    def _watchdog(self, signum: int, loop: asyncio.AbstractEventLoop) -> None:
        """End a demo still running a grace after the signal; say where it was stuck (stderr): each
        thread, and each task of the loop (a loop idle in select is waiting on one of them)."""
        time.sleep(self.grace_seconds)
        name = signal.Signals(signum).name
        print(f"kvcanary demo: not stopped {self.grace_seconds:.0f}s after {name}; stopping now",
              file=sys.stderr, flush=True)  # fmt: skip
        faulthandler.dump_traceback(all_threads=True)
        for task in list(asyncio.all_tasks(loop)):
            with contextlib.suppress(Exception):  # a task that ends meanwhile: its stack is moot
                print(f"task {task.get_name()}:", file=sys.stderr, flush=True)
                task.print_stack(limit=12, file=sys.stderr)
        stop_processes(list(self.children))
        os._exit(128 + signum)


class DemoServer(uvicorn.Server):
    """uvicorn serving the demo's monitor on loopback, telling the demo's stop of each signal it
    takes while it serves."""

    def __init__(self, app: Any, settings: Settings, stop: DemoStop) -> None:
        grace = settings.api.shutdown_grace_seconds
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=settings.api.port,
            log_level="warning",
            lifespan="on",
            # As `kvcanary serve` does: requests still open after the grace (a gateway's long poll
            # of the quarantine set) are cut, not awaited; awaited, the demo hung on Ctrl-C.
            timeout_graceful_shutdown=max(1, round(grace)),
        )
        super().__init__(config)
        self._stop = stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._stop.note(sig, frame)
        super().handle_exit(sig, frame)
