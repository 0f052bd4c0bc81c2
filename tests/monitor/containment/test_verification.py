"""A suspicion verified at once (``monitor/containment/verification.py``), by the real runner against
reference workers as processes: a kind none of whose runs was judged is run once more, a proof or a
judged pass is not, and what the rounds found is written in the incident's timeline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest
from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings, parse_settings
from kvcanary.monitor.containment.verification import RETRY_SECONDS, Verifier
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.result_writer import NotRecorded
from kvcanary.monitor.runs.runner import ProbeRunner
from kvcanary.monitor.storage.models import IncidentEvent
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import PLACEHOLDER, REJECT
from tests.support import WorkerProcess, free_port
from tests.support.monitor_db import minutes, outcome, record

Factory = sessionmaker[Session]
StartWorker = Callable[..., WorkerProcess]


def settings_for(port: int, kinds: Sequence[str]) -> Settings:
    return parse_settings(
        {
            "targets": [
                {
                    "name": "t",
                    "base_url": f"http://127.0.0.1:{port}",
                    "engine": "reference",
                    "model": "kvcanary-reference",
                    "tenants": [{"name": "alice"}, {"name": "bob"}],
                    "timeout_seconds": 20,
                    "probes": list(kinds),
                }
            ],
        }
    )


class Verification:
    """A verifier over a real runner whose pause is the test's: what a node does while it waits."""

    def __init__(self, settings: Settings, factory: Factory, meanwhile: Callable[[], None] = lambda: None):
        target = settings.targets[0]
        clients = {target.name: OpenAIHttpTarget(target, {t.name: None for t in target.tenants})}
        metrics = MonitorMetrics(CollectorRegistry())
        self.runner = ProbeRunner(settings, clients, MarkerBook(), metrics, NotRecorded())
        self.counter = Counter("verifications", "", ["target", "outcome"], registry=CollectorRegistry())
        self.pauses: list[float] = []
        self.meanwhile = meanwhile
        self.verifier = Verifier(lambda: settings, self.runner.run, factory, self.counter, pause=self._pause)
        suspected = record(factory, "leak", at=minutes(0), target="t", certainty="suspected")
        self.incident_id = suspected.incident_id
        self.item = PendingResult.of(target, "traffic_overlap", outcome("leak"), minutes(0), 0.1)

    async def _pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        await asyncio.to_thread(self.meanwhile)

    def run(self) -> str:
        async def verify() -> str:
            try:
                task = self.verifier.suspect(self.item, self.incident_id or 0)
                assert task is not None
                return await task
            finally:
                for client in self.runner.clients.values():
                    await self.runner.close_when_idle(client)

        return asyncio.run(verify())


def timeline(factory: Factory, incident_id: int | None) -> list[tuple[str, str]]:
    with factory() as s:
        rows = s.scalars(select(IncidentEvent).where(IncidentEvent.incident_id == incident_id))
        return [(e.reason or "", e.note or "") for e in rows if e.kind == "verification"]


def test_a_node_down_for_the_first_round_is_verified_once_it_is_back(
    session_factory: Factory, start_worker: StartWorker
) -> None:
    port = free_port()
    check = Verification(
        settings_for(port, ["cross_tenant"]), session_factory, lambda: start_worker(*REJECT, port=port)
    )
    assert check.run() == "none_found"
    assert check.pauses == [RETRY_SECONDS]
    [(reason, note)] = timeline(session_factory, check.incident_id)
    assert reason == "none_found"
    assert note.startswith("cross_tenant: error (") and "; cross_tenant: pass, in " in note, note


def test_a_node_down_through_both_rounds_is_not_judged_and_not_tried_a_third_time(
    session_factory: Factory,
) -> None:
    check = Verification(settings_for(free_port(), ["cross_tenant", "canary"]), session_factory)
    assert check.run() == "not_judged"
    assert check.pauses == [RETRY_SECONDS]
    [(reason, note)] = timeline(session_factory, check.incident_id)
    assert reason == "not_judged"
    assert note.count("cross_tenant: error") == 2 and note.count("canary: error") == 2, note
    assert check.counter.labels("t", "not_judged")._value.get() == 1


@pytest.mark.parametrize(("worker", "found"), [(REJECT, "none_found"), (PLACEHOLDER, "leak_found")])
def test_a_round_that_judged_every_kind_is_not_run_again(
    session_factory: Factory, start_worker: StartWorker, worker: tuple[str, ...], found: str
) -> None:
    node = start_worker(*worker)
    check = Verification(settings_for(node.port, ["cross_tenant", "boundary"]), session_factory)
    assert check.run() == found
    assert check.pauses == []
    [(reason, note)] = timeline(session_factory, check.incident_id)
    assert reason == found and note.count("cross_tenant: ") == 1 and note.count("boundary: ") == 1, note


def test_the_kinds_run_one_at_a_time_so_the_boundary_prime_is_what_a_stale_read_meets(
    session_factory: Factory, start_worker: StartWorker
) -> None:
    """Side by side, the other kinds' freed pages (the probing tenant's own) could be what the
    defective node's over-capacity answer read: a mismatch where the node leaks. One at a time, the
    boundary run's own prime of another tenant's markers is, on every round."""
    node = start_worker(*PLACEHOLDER)
    kinds = ["canary", "cross_tenant", "boundary"]
    for rounds in range(1, 4):
        check = Verification(settings_for(node.port, kinds), session_factory)
        assert check.run() == "leak_found"
        notes = timeline(session_factory, check.incident_id)  # one incident: a round's note each
        assert len(notes) == rounds and "boundary: leak (foreign_marker)" in notes[-1][1], notes


def test_a_proof_ends_the_round(session_factory: Factory, start_worker: StartWorker) -> None:
    node = start_worker(*PLACEHOLDER)
    check = Verification(settings_for(node.port, ["boundary", "cross_tenant", "canary"]), session_factory)
    assert check.run() == "leak_found"
    [(_, note)] = timeline(session_factory, check.incident_id)
    assert note.startswith("boundary: leak (") and "cross_tenant" not in note and "canary" not in note, note
