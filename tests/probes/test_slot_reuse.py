"""slot_reuse: a request taking the batch slot another tenant's request just left gets only its own.

Against the reference worker with and without its ``slot-stale-tokens`` bug (a slot freed while the
batch ran is prefilled from its previous occupant's tokens), and at the network seam for what a run
sends, in what order, and how an answer holding its predecessor's marker is judged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import Call, FakeEngine, answer, run_kind

BATCH = ("--mode", "aggregated", "--kv-pool-tokens", "8192", "--max-batch", "16")
BUGGY = (*BATCH, "--bug", "slot-stale-tokens")


def test_a_worker_writing_each_slots_prompt_before_prefill_passes(reference) -> None:  # type: ignore[no-untyped-def]
    worker = reference(*BATCH)
    for _ in range(2):
        verdict, reason, evidence = run_kind("slot_reuse", worker)
        assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
        # A pass says something only where a pair joined while the batch ran; how many did is the
        # machine's pace (4 of 4 on a quiet host, 2 of 4 beside a second suite on 2 cores).
        assert evidence["pairs_while_busy"] >= 1, evidence
        steps = [t["step"] for t in evidence["tenants"]]
        assert steps[:8] == [f"pair {k} {half}" for k in range(4) for half in ("first", "next")]
        assert steps[8:] == ["busy 0", "busy 1"]


def test_a_worker_prefilling_a_reused_slot_from_its_previous_occupant_leaks(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = run_kind("slot_reuse", reference(*BUGGY))
    assert (verdict, reason) == (Verdict.LEAK, "foreign_marker"), evidence
    # Requests that took the slot their predecessor (the other tenant) had just left: how many join
    # while the batch still runs is the machine's pace (6 of 8 on a quiet host, 4 with 3 pairs while
    # busy under a loaded test run), so at least one pair's both halves, and only pairs.
    crossed = [t["step"] for t in evidence["tenants"] if t["reason"] == "other_request_marker"]
    assert len(crossed) >= 2 and all(step.startswith("pair") for step in crossed), evidence
    assert {leak["owner_tenant"] for leak in evidence["leaks"]} == {"alice", "bob"}


def _run(fake: FakeEngine, engine: str, **options: Any) -> tuple[Verdict, str, dict[str, Any]]:
    async def go() -> tuple[Verdict, str, dict[str, Any]]:
        async with fake.target(engine=engine) as target:
            update = {"probes": ["slot_reuse"], "options": {"slot_reuse": {"repeats": True, **options}}}
            config = target._config.model_copy(update=update)
            result, _ = await execute_probe("slot_reuse", target, MarkerBook(), config)
        return result.verdict, result.reason, result.evidence

    return asyncio.run(go())


def test_each_request_is_sent_once_the_previous_one_ended_while_the_busy_ones_run() -> None:
    order: list[tuple[str, str]] = []

    async def reply(call: Call) -> httpx.Response:
        busy = call.body["max_tokens"] > 96
        order.append(("start", "busy" if busy else call.markers[0]))
        await asyncio.sleep(1.0 if busy else 0.01)  # the busy answers outlast the pairs
        order.append(("end", "busy" if busy else call.markers[0]))
        return FakeEngine.echo(call)

    fake = FakeEngine(reply=reply)
    verdict, reason, evidence = _run(fake, "vllm", pairs=3, busy_tokens=300)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    busy = [c for c in fake.calls if c.body["max_tokens"] > 96]
    assert len(busy) == 2 and all(c.body["ignore_eos"] is True and c.body["max_tokens"] == 300 for c in busy)
    assert len(busy[0].prompt) >= 300 and {c.tenant for c in busy} == {"alice", "bob"}
    pairs = [event for event in order if event[1] != "busy"]
    # One at a time: each pair request starts only after the one before it ended.
    assert all(
        pairs[i][0] == "start" and pairs[i + 1] == ("end", pairs[i][1]) for i in range(0, len(pairs), 2)
    )
    assert order.index(("end", "busy")) > len(order) - 3  # the busy ones were still running throughout
    tenants = [c.tenant for c in fake.calls if c.body["max_tokens"] <= 96]
    assert tenants == ["alice", "bob"] * 3
    assert evidence["pairs_while_busy"] == 3


def test_an_answer_holding_its_predecessors_marker_is_a_leak_naming_the_step() -> None:
    previous: list[str] = []

    def reply(call: Call) -> httpx.Response:
        if call.body["max_tokens"] > 96:
            return FakeEngine.echo(call)
        text = call.prompt if len(previous) != 3 else f"{previous[-1]} {call.prompt}"
        previous.extend(call.markers)
        return answer(call, text)

    verdict, reason, evidence = _run(FakeEngine(reply=reply), "reference", pairs=2, busy_tokens=128)
    assert (verdict, reason) == (Verdict.LEAK, "foreign_marker"), evidence
    [crossed] = [t for t in evidence["tenants"] if t["reason"] == "other_request_marker"]
    assert crossed["step"] == "pair 1 next" and crossed["tenant"] == "bob"
    assert [leak["owner_tenant"] for leak in evidence["leaks"]] == ["alice"]


def test_the_busy_answers_are_judged_on_other_markers_only() -> None:
    def reply(call: Call) -> httpx.Response:
        if call.body["max_tokens"] > 96:  # a long answer that drifted away from its own marker
            return answer(call, "the rest of a long answer " * 8)
        return FakeEngine.echo(call)

    verdict, reason, evidence = _run(FakeEngine(reply=reply), "reference", pairs=1, busy_tokens=128)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    assert [t["reason"] for t in evidence["tenants"] if t["step"].startswith("busy")] == [
        "no_foreign_marker"
    ] * 2


def test_a_busy_answer_that_cannot_be_judged_decides_nothing() -> None:
    def reply(call: Call) -> httpx.Response:
        if call.body["max_tokens"] > 96:  # an engine too loaded to finish the long answers
            return httpx.Response(503, json={"error": {"message": "overloaded", "code": 503}})
        return FakeEngine.echo(call)

    verdict, reason, evidence = _run(FakeEngine(reply=reply), "reference", pairs=1, busy_tokens=128)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    busy = [t["reason"] for t in evidence["tenants"] if t["step"].startswith("busy")]
    assert busy == ["busy_unjudged"] * 2
