"""session: a conversation continued after other tenants' traffic and a churn burst keeps its own markers.

Against the reference worker with a session cache (``--session-cache 8``: finished sequences' K/V in
host memory, restored when a conversation returns), with and without its ``session-restore`` bug
(a reused slot's old entry stays visible), and at the network seam for what a run sends.
"""

from __future__ import annotations

import asyncio

from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import FakeEngine, run_kind

CACHED = ("--mode", "aggregated", "--kv-pool-tokens", "4096", "--session-cache", "8")
BUGGY = (*CACHED, "--bug", "session-restore")


def test_a_session_cache_that_drops_overwritten_entries_passes(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = run_kind("session", reference(*CACHED))
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    steps = [t["step"] for t in evidence["tenants"]]
    assert steps == ["first_turn"] * 2 + ["other_traffic"] * 2 + ["revisit"] * 2
    # Sized from the pool (4,096 tokens) in prompts of about 256: the 8-slot ring goes round twice.
    assert evidence["churn"] == {"requests": 16, "answered": 16, "tokens_asked": 4096}


def test_a_conversation_restored_from_a_reused_slot_is_caught(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, _, evidence = run_kind("session", reference(*BUGGY))
    # Each revisit is restored from a burst prompt saved over its slot: a marker of another tenant,
    # or of another request of its own tenant: either way another conversation's context, a leak
    # (a verdict the benign engine never earns: tests/probes/test_benign_engine.py).
    assert verdict is Verdict.LEAK, evidence
    revisits = [t for t in evidence["tenants"] if t["step"] == "revisit"]
    assert [t["reason"] for t in revisits] == ["restored_foreign_conversation"] * 2, evidence


def test_without_churn_the_buggy_cache_still_holds_the_conversations(reference) -> None:  # type: ignore[no-untyped-def]
    # The defect needs the trigger: with no burst the ring never goes round, nothing is stale.
    verdict, reason, evidence = run_kind("session", reference(*BUGGY), churn_tokens=0)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence


def test_the_revisit_sends_the_whole_history_back_and_the_burst_is_bounded() -> None:
    fake = FakeEngine()

    async def go() -> None:
        async with fake.target(engine="vllm") as target:
            options = {"session": {"churn_tokens": 100_000, "max_churn_tokens": 1_024, "repeats": True}}
            config = target._config.model_copy(update={"probes": ["session"], "options": options})
            await execute_probe("session", target, MarkerBook(), config)

    asyncio.run(go())
    calls = [c for c in fake.calls if c.path.endswith("completions")]
    burst = [c for c in calls if not c.chat]
    assert len(burst) == 4  # 1,024 tokens at most, in prompts of about 256
    revisits = [c for c in calls if c.chat and len(c.body["messages"]) == 3]
    assert len(revisits) == 2
    for call in revisits:
        user, _, question = call.body["messages"]
        assert [m["role"] for m in call.body["messages"]] == ["user", "assistant", "user"]
        assert (
            call.markers and call.markers[0] in user["content"] and "What was the code" in question["content"]
        )
