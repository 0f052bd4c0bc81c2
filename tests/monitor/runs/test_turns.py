"""A target's turns: a kind that runs alone (``boundary``) meets no other kind's run on its target."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta

from prometheus_client import CollectorRegistry

from kvcanary.monitor.config.settings import parse_settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.recording.result_writer import NotRecorded
from kvcanary.monitor.runs.runner import ProbeRunner, RunSummary
from kvcanary.monitor.runs.turns import SHARED, TargetTurns
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import PLACEHOLDER
from tests.support import WorkerProcess


class Log:
    """Who entered and left a turn, in order; ``inside`` who holds it now."""

    def __init__(self, turns: TargetTurns) -> None:
        self.turns = turns
        self.events: list[str] = []
        self.inside: set[str] = set()
        self.most_inside: dict[str, int] = {}

    async def hold(self, name: str, group: str, leave: asyncio.Event, target: str = "t") -> None:
        async with self.turns.take(target, group):
            self.events.append(f"+{name}")
            self.inside.add(name)
            self.most_inside[name] = len(self.inside)
            await leave.wait()
            self.inside.discard(name)
            self.events.append(f"-{name}")


def ends(run: RunSummary) -> datetime:
    return run.started_at + timedelta(seconds=run.duration_seconds)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_shared_runs_share_the_turn_and_a_lone_run_waits_for_them_to_end() -> None:
    async def scene() -> list[str]:
        log, leave = Log(TargetTurns()), {n: asyncio.Event() for n in ("canary", "cross", "boundary")}
        tasks = [asyncio.create_task(log.hold("canary", SHARED, leave["canary"]))]
        tasks.append(asyncio.create_task(log.hold("cross", SHARED, leave["cross"])))
        await settle()
        assert log.inside == {"canary", "cross"}
        tasks.append(asyncio.create_task(log.hold("boundary", "boundary", leave["boundary"])))
        await settle()
        assert "boundary" not in log.inside
        leave["canary"].set()
        await settle()
        assert log.inside == {"cross"}, "the lone run waits for every shared run, not the first to end"
        leave["cross"].set()
        await settle()
        assert log.inside == {"boundary"}
        leave["boundary"].set()
        await asyncio.gather(*tasks)
        return log.events

    assert asyncio.run(scene()) == ["+canary", "+cross", "-canary", "-cross", "+boundary", "-boundary"]


def test_a_shared_run_that_comes_after_a_waiting_lone_run_waits_behind_it() -> None:
    """A busy target would otherwise starve the lone kind: shared runs overlapping without end."""

    async def scene() -> list[str]:
        log, leave = Log(TargetTurns()), {n: asyncio.Event() for n in ("canary", "boundary", "cross")}
        tasks = [asyncio.create_task(log.hold("canary", SHARED, leave["canary"]))]
        await settle()
        tasks.append(asyncio.create_task(log.hold("boundary", "boundary", leave["boundary"])))
        await settle()
        tasks.append(asyncio.create_task(log.hold("cross", SHARED, leave["cross"])))
        await settle()
        assert log.inside == {"canary"}
        leave["canary"].set()
        await settle()
        assert log.inside == {"boundary"}
        leave["boundary"].set()
        await settle()
        assert log.inside == {"cross"}
        leave["cross"].set()
        await asyncio.gather(*tasks)
        return log.events

    assert asyncio.run(scene()) == ["+canary", "-canary", "+boundary", "-boundary", "+cross", "-cross"]


def test_a_lone_kinds_runs_share_their_turn_and_other_targets_are_not_held() -> None:
    """Its runs on several paths of one target run side by side, as before; another target's runs
    never wait on this one's turn."""

    async def scene() -> Log:
        log, leave = Log(TargetTurns()), asyncio.Event()
        tasks = [
            asyncio.create_task(log.hold("boundary@p1", "boundary", leave)),
            asyncio.create_task(log.hold("boundary@p2", "boundary", leave)),
            asyncio.create_task(log.hold("other target's canary", SHARED, leave, target="u")),
        ]
        await settle()
        assert len(log.inside) == 3
        leave.set()
        await asyncio.gather(*tasks)
        return log

    assert max(asyncio.run(scene()).most_inside.values()) == 3


def test_a_run_cancelled_while_it_waits_keeps_nobody_out_and_an_idle_turn_is_forgotten() -> None:
    async def scene() -> TargetTurns:
        turns = TargetTurns()
        log, leave = Log(turns), {n: asyncio.Event() for n in ("canary", "boundary", "cross")}
        first = asyncio.create_task(log.hold("canary", SHARED, leave["canary"]))
        await settle()
        waiting = asyncio.create_task(log.hold("boundary", "boundary", leave["boundary"]))
        await settle()
        waiting.cancel()
        await settle()
        later = asyncio.create_task(log.hold("cross", SHARED, leave["cross"]))
        await settle()
        assert log.inside == {"canary", "cross"}, "a cancelled lone waiter still held the shared runs back"
        leave["canary"].set()
        leave["cross"].set()
        await asyncio.gather(first, later)
        assert waiting.cancelled() and "+boundary" not in log.events
        return turns

    assert asyncio.run(scene())._turns == {}


def test_only_the_kind_that_primes_the_free_list_runs_alone() -> None:
    assert [kind for kind, probe in REGISTRY.items() if probe.runs_alone] == ["boundary"]


def test_the_boundary_prime_is_what_a_stale_read_meets_while_the_other_kinds_run_beside_it(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """The scheduler starts a target's kinds together. Side by side, the other kinds' freed pages
    (the probing tenant's own) could be what the defective node's over-capacity answer read: a
    mismatch where the node leaks (1 of 29 rounds measured). With the turn, no other kind's run overlaps
    boundary's, and its own prime is what the stale read meets, every round."""
    node = start_worker(*PLACEHOLDER)
    kinds = ["canary", "cross_tenant", "boundary"]
    settings = parse_settings(
        {
            "targets": [
                {
                    "name": "t",
                    "base_url": node.url,
                    "engine": "reference",
                    "model": "kvcanary-reference",
                    "tenants": [{"name": "alice"}, {"name": "bob"}],
                    "timeout_seconds": 20,
                    "probes": kinds,
                }
            ],
        }
    )
    target = settings.targets[0]
    client = OpenAIHttpTarget(target, {t.name: None for t in target.tenants})
    metrics = MonitorMetrics(CollectorRegistry())
    runner = ProbeRunner(settings, {"t": client}, MarkerBook(), metrics, NotRecorded())

    async def rounds() -> list[tuple[str, str]]:
        seen = []
        try:
            for _ in range(5):
                summaries = [s for [s] in await asyncio.gather(*(runner.run("t", kind) for kind in kinds))]
                [boundary] = [s for s in summaries if s.kind == "boundary"]
                for other in (s for s in summaries if s is not boundary):
                    assert ends(other) <= boundary.started_at or other.started_at >= ends(boundary), (
                        f"{other.kind} ran beside boundary"
                    )
                seen.append((boundary.result.verdict.value, boundary.result.reason))
        finally:
            await client.aclose()
        return seen

    assert asyncio.run(rounds()) == [(Verdict.LEAK.value, "foreign_marker")] * 5
