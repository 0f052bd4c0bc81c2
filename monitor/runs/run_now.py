"""Run-now requests (``POST /api/v1/targets/{name}/run``): coalesced, rate-limited, never a load amplifier.

On main, 100 requests whose clients gave up after 2 s made the monitor run 373 probes against one
target. Here a request starts a run only when none is queued or in flight for that target (it
joins that one otherwise) and the last one finished at least ``min_interval`` ago (else
:class:`RateLimited` says when to come back). The run belongs to the monitor, not to the HTTP
request: a client that goes away cancels nothing, and nothing it asked for is run twice. Finished
runs are kept (the latest few) so that a ``202`` can be followed up.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

#: How many finished runs are kept to be read back, across targets.
KEEP_FINISHED = 200

RunTarget = Callable[[str], Coroutine[Any, Any, list[dict[str, Any]]]]


class RateLimited(Exception):
    """The target was run on request too recently; ``retry_after`` is in seconds."""

    def __init__(self, retry_after: float, last: RunJob):
        super().__init__(f"run again in {retry_after:.0f}s")
        self.retry_after = retry_after
        self.last = last


@dataclass
class RunJob:
    """One run of every probe of a target, asked for over the API."""

    id: str
    target: str
    started: float
    task: asyncio.Task[list[dict[str, Any]]]
    finished: float | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def done(self) -> bool:
        # Its results are in, not merely its task over: the done-callback runs a loop turn later.
        return self.finished is not None

    @property
    def status(self) -> Literal["running", "done", "failed"]:
        if not self.done:
            return "running"
        return "failed" if self.error else "done"


class RunNow:
    """Starts, coalesces and remembers run-now jobs; one event loop, no locks needed."""

    def __init__(self, run_target: RunTarget, min_interval: float):
        self._run_target = run_target
        self.min_interval = min_interval
        self._latest: dict[str, RunJob] = {}
        self._jobs: OrderedDict[str, RunJob] = OrderedDict()

    def request(self, target: str) -> tuple[RunJob, bool]:
        """Return the job that will answer this request and whether it is new.

        Raise RateLimited when the target's last requested run finished under ``min_interval`` ago.
        """
        last = self._latest.get(target)
        if last is not None and not last.done:
            return last, False
        if last is not None and last.finished is not None:
            wait = self.min_interval - (time.monotonic() - last.finished)
            if wait > 0:
                raise RateLimited(wait, last)
        job_id = secrets.token_hex(6)
        task = asyncio.get_running_loop().create_task(self._run_target(target), name=f"run-now:{target}")
        job = RunJob(job_id, target, time.monotonic(), task)
        task.add_done_callback(lambda t, j=job: _finish(j, t))  # type: ignore[misc]
        self._latest[target] = job
        self._jobs[job_id] = job
        while len(self._jobs) > KEEP_FINISHED and next(iter(self._jobs.values())).done:
            self._jobs.popitem(last=False)
        return job, True

    def get(self, target: str, job_id: str) -> RunJob | None:
        job = self._jobs.get(job_id)
        return job if job is not None and job.target == target else None

    async def wait(self, job: RunJob, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``job``; return whether it finished. The job is never cancelled."""
        if not job.done and seconds > 0:
            await asyncio.wait({job.task}, timeout=seconds)
            await asyncio.sleep(0)  # let the done-callback record the results
        return job.done


def _finish(job: RunJob, task: asyncio.Task[list[dict[str, Any]]]) -> None:
    if task.cancelled():
        job.error = "cancelled: the monitor is shutting down"
    elif (exc := task.exception()) is not None:
        job.error = f"{type(exc).__name__}: {exc}"
    else:
        job.results = task.result()
    job.finished = time.monotonic()  # last: ``done`` means the results are there to read
