"""The probe clock: one APScheduler 3.x job per (target, probe kind), plus housekeeping.

Each job fires at the target's interval for that kind with jitter, ``max_instances=1`` so a slow
run is never overlapped by the next, and ``coalesce=True`` so a backlog after a pause collapses
into one run. Concurrency across jobs is bounded by the runner's semaphore.

A run due while the last one still runs is skipped. APScheduler says so on every skip, which a
half-second housekeeping job on a slow database turns into two lines a second; the monitor says it
instead, once a ``SKIPS_QUIET_SECONDS`` episode per job, with how many were skipped.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_SUBMITTED, JobSubmissionEvent
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.runs.runner import ProbeRunner

log = logging.getLogger("kvcanary.scheduler")

#: Housekeeping first runs this soon after start (or at its interval, when shorter).
FIRST_HOUSEKEEPING_SECONDS = 30

Housekeeping = tuple[str, Callable[[], Awaitable[None]], float]
#: Whether this replica runs (target, kind) (``monitor/runs/replicas.py``).
Owns = Callable[[str, str], bool]

#: Skipped runs of one job this close together are one episode, said in one line.
SKIPS_QUIET_SECONDS = 60.0
#: What APScheduler's own line for a skipped run says (``apscheduler.scheduler``, a warning).
_APSCHEDULER_SKIP = "maximum number of running instances reached"


class _NotSkips(logging.Filter):
    """Lets through every APScheduler line but a skipped run's: :class:`_Skips` says those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _APSCHEDULER_SKIP not in str(record.msg)


_NOT_SKIPS = _NotSkips()


class _Skips:
    """Says a job's skipped runs once an episode, with how many the last line did not say."""

    def __init__(self) -> None:
        self.said_at: dict[str, float] = {}
        self.unsaid: dict[str, int] = {}

    def __call__(self, event: JobSubmissionEvent) -> None:
        job, now = event.job_id, time.monotonic()
        if now - self.said_at.get(job, float("-inf")) < SKIPS_QUIET_SECONDS:
            self.unsaid[job] = self.unsaid.get(job, 0) + 1
            return
        since = self.unsaid.pop(job, 0)
        self.said_at[job] = now
        log.warning("%s: a run was due while the last one still ran, and was skipped%s: the job takes "
                    "longer than its interval (a slow database or engine, or a loaded machine)", job,
                    f" ({since} more since this was last said)" if since else "")  # fmt: skip


def spread(target: str, kind: str) -> float:
    """Return a stable fraction in [0, 1) for (target, kind): where in its interval its runs fall."""
    digest = hashlib.blake2b(f"{target}\0{kind}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


#: Where every pair's phase is counted from, on every replica.
PHASE_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


def next_in_phase(after: datetime, interval: float, fraction: float) -> datetime:
    """Return the first moment at or after ``after`` that lies ``fraction`` of an interval past a
    whole number of intervals since :data:`PHASE_EPOCH`."""
    offset = fraction * interval
    periods = math.ceil(((after - PHASE_EPOCH).total_seconds() - offset) / interval)
    return PHASE_EPOCH + timedelta(seconds=offset + periods * interval)


def build_scheduler(
    settings: Settings,
    runner: ProbeRunner,
    housekeeping: Sequence[Housekeeping] = (),
    owns: Owns = lambda target, kind: True,
) -> AsyncIOScheduler:
    """Return a scheduler (not started) with a job for every configured (target, probe).

    Runs are spread evenly over each interval, by a hash of (target, probe): a restart (or 5,000
    targets) does not fire every probe in one burst. The offset is counted from a fixed date, not
    from this process's start, so every replica places a pair's runs at the same moments: a pair
    taken over runs when it would have run anyway (never up to two intervals apart), and a job
    paused and resumed (``assign``) keeps its place.
    Jobs of pairs this replica does not ``own`` are added paused. ``housekeeping`` adds
    ``(name, coroutine function, interval seconds)`` jobs (pruning, replay, heartbeat).
    """
    scheduler = AsyncIOScheduler(timezone=UTC, job_defaults={"misfire_grace_time": 30})
    now = datetime.now(UTC)
    pairs = [(target.name, kind) for target in settings.targets for kind in target.probes]
    add_probe_jobs(scheduler, settings, runner, pairs, owns)
    for name, func, interval in housekeeping:
        scheduler.add_job(
            func,
            IntervalTrigger(seconds=interval),
            id=f"housekeeping:{name}",
            coalesce=True,
            max_instances=1,
            # Soon after start, not an interval later: a restarted monitor prunes expired evidence
            # and replays its spool within the first minute.
            next_run_time=now + timedelta(seconds=min(interval, FIRST_HOUSEKEEPING_SECONDS)),
        )
    scheduler.add_listener(_noting_due(runner), EVENT_JOB_SUBMITTED)
    scheduler.add_listener(_Skips(), EVENT_JOB_MAX_INSTANCES)
    apscheduler_log = logging.getLogger("apscheduler.scheduler")
    if _NOT_SKIPS not in apscheduler_log.filters:
        apscheduler_log.addFilter(_NOT_SKIPS)
    return scheduler


def _noting_due(runner: ProbeRunner) -> Callable[[JobSubmissionEvent], None]:
    """Return a listener that tells ``runner`` when each probe run was due (its schedule lag)."""

    def submitted(event: JobSubmissionEvent) -> None:
        prefix, _, rest = event.job_id.partition(":")
        if prefix == "probe" and event.scheduled_run_times:
            target, _, kind = rest.rpartition(":")
            runner.note_due(target, kind, event.scheduled_run_times[-1])

    return submitted


def run_now(scheduler: AsyncIOScheduler, target: str, kinds: Sequence[str]) -> None:
    """Move the next run of each of ``target``'s ``kinds`` to now, where this replica runs it (a
    paused job is another replica's)."""
    now = datetime.now(UTC)
    for kind in kinds:
        job = scheduler.get_job(probe_job_id(target, kind))
        if job is not None and job.next_run_time is not None:
            job.modify(next_run_time=now)


def add_probe_jobs(
    scheduler: AsyncIOScheduler,
    settings: Settings,
    runner: ProbeRunner,
    pairs: Sequence[tuple[str, str]],
    owns: Owns,
) -> None:
    """Add the job of each (target, kind) in ``pairs``, placed in its interval by its spread."""
    now = datetime.now(UTC)
    jitter = settings.scheduler.jitter_seconds
    for name, kind in pairs:
        target = settings.target(name)
        assert target is not None, name
        interval = target.interval_for(kind)
        first = next_in_phase(now + timedelta(seconds=0.2), interval, spread(name, kind))
        spread_out = min(jitter, interval / 4) or None
        trigger = IntervalTrigger(seconds=interval, start_date=first, jitter=spread_out)
        scheduler.add_job(
            runner.run_scheduled,
            trigger,
            args=[name, kind],
            id=probe_job_id(name, kind),
            name=f"{kind} on {name}",
            coalesce=True,
            max_instances=1,
            next_run_time=first if owns(name, kind) else None,  # None: paused
        )


def probe_job_id(target: str, kind: str) -> str:
    return f"probe:{target}:{kind}"


def assign(
    scheduler: AsyncIOScheduler, settings: Settings, owns: Owns
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Resume the probe jobs this replica now owns and pause the others; return the (target, kind)
    pairs gained and lost.

    Called when the set of live replicas changes. A paused job costs nothing per interval, so
    three replicas spend their CPU on their own third of the runs, not on skipping the rest.
    """
    gained, lost = [], []
    for target in settings.targets:
        for kind in target.probes:
            job = scheduler.get_job(probe_job_id(target.name, kind))
            if job is None:
                continue
            mine, running = owns(target.name, kind), job.next_run_time is not None
            if mine and not running:
                job.resume()  # the trigger's phase gives the next run, spread as before
                gained.append((target.name, kind))
            elif not mine and running:
                job.pause()
                lost.append((target.name, kind))
    return gained, lost
