"""full_batch: a batch filled with every tenant's requests, parameters mixed, gives each its own answer.

Against the reference worker with and without its ``batch-crossed`` bug (a full batch of mixed
budgets hands each row another row's tokens), and at the network seam for what a run sends.
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
BUGGY = (*BATCH, "--bug", "batch-crossed")


def test_a_worker_keeping_rows_apart_passes_a_batch_of_its_published_size(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = run_kind("full_batch", reference(*BATCH))
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    assert evidence["batch_size"] == 16  # max_running_requests in /get_server_info
    assert len(evidence["tenants"]) == 16


def test_a_worker_crossing_the_rows_of_a_full_mixed_batch_leaks(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = run_kind("full_batch", reference(*BUGGY))
    # Rows get other rows' answers whole: another tenant's marker (a leak), or, where the crossing
    # stayed within a tenant (the batch's order follows arrival), another request's (a mismatch).
    assert (verdict, reason) in ((Verdict.LEAK, "foreign_marker"), (Verdict.MISMATCH, "other_request_marker"))
    crossed = [t for t in evidence["tenants"] if t["reason"] == "other_request_marker"]
    assert len(crossed) >= 2, evidence


def test_a_small_batch_does_not_trigger_the_defect(reference) -> None:  # type: ignore[no-untyped-def]
    # The defect needs its trigger: below 8 rows the batch is never grouped.
    verdict, reason, evidence = run_kind("full_batch", reference(*BUGGY), size=4)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence


def test_rows_vary_their_parameters_and_every_choice_is_scanned() -> None:
    fake = FakeEngine()

    async def reply(call: Call) -> httpx.Response:
        """The echo; asked for two choices, the second carries a marker another tenant was given."""
        if call.body.get("n") != 2:
            return answer(call, call.prompt[: call.body["max_tokens"]])
        await asyncio.sleep(0.05)  # every row has arrived by now
        foreign = next(m for c in fake.calls if c.tenant != call.tenant for m in c.markers)
        choices = [{"message": {"content": call.prompt}, "finish_reason": "stop"},
                   {"message": {"content": f"also: {foreign}"}, "finish_reason": "stop"}]  # fmt: skip
        return httpx.Response(
            200, json={"choices": choices, "usage": {"prompt_tokens": 40, "completion_tokens": 9}}
        )

    fake.reply = reply

    async def go() -> tuple[Verdict, str, dict[str, Any]]:
        async with fake.target(engine="vllm") as target:
            options = {"full_batch": {"size": 10, "repeats": True}}
            config = target._config.model_copy(update={"probes": ["full_batch"], "options": options})
            result, _ = await execute_probe("full_batch", target, MarkerBook(), config)
        return result.verdict, result.reason, result.evidence

    verdict, _, evidence = asyncio.run(go())
    rows = [c for c in fake.calls if "Remember this code" in c.prompt]
    assert len(rows) == 10
    bodies = [c.body for c in rows]
    assert {b["max_tokens"] for b in bodies} == {96, 128, 160, 192}
    assert sum(b["temperature"] > 0 for b in bodies) == 6  # every second row, and the n = 2 ones
    assert sum(b.get("repetition_penalty") == 1.1 for b in bodies) == 3
    assert sum(b.get("stop") == ["\n\n\n\n"] for b in bodies) == 2
    assert [b.get("n") for b in bodies].count(2) == 2 and all(not b["stream"] for b in bodies if b.get("n"))
    # The marker in a second choice is found: another tenant's, so a leak.
    assert verdict is Verdict.LEAK, evidence
