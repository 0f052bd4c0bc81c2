"""session: a conversation continued after other tenants' traffic and a churn burst keeps its own markers.

Against the reference worker with a session cache (``--session-cache 8``: finished sequences' K/V in
host memory, restored when a conversation returns, and written through to an offload tier), with
and without its ``session-restore`` bug (a reused slot's old entry stays visible) and its
``session-offload-chunks`` bug (the offload tier's chunks keyed by position alone), and at the
network seam for what a run sends and for an engine that answers a returning conversation with
another caller's latest long prompt.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import Call, FakeEngine, answer, run_kind

CACHED = ("--mode", "aggregated", "--kv-pool-tokens", "4096", "--session-cache", "8")
BUGGY = (*CACHED, "--bug", "session-restore")
OFFLOAD_BUG = (*CACHED, "--bug", "session-offload-chunks")


def test_a_session_cache_that_drops_overwritten_entries_passes(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = run_kind("session", reference(*CACHED))
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    steps = [t["step"] for t in evidence["tenants"]]
    plant = [f"plant {turn}" for turn in range(1, 5) for _ in range(2)]
    assert steps == ["first_turn"] * 2 + ["other_traffic"] * 2 + plant + ["revisit"] * 2
    # Sized from the pool (4,096 tokens) in prompts of about 256: the 8-slot ring goes round twice.
    assert evidence["churn"] == {"requests": 16, "answered": 16, "tokens_asked": 4096}
    # The last plant prompt is about plant_chars: at most half the node's limit (2,047 here).
    assert evidence["plant"]["requests"] == 8 and 1_800 <= evidence["plant"]["longest_chars"] <= 2_047


def test_a_conversation_restored_from_a_reused_slot_is_caught(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, _, evidence = run_kind("session", reference(*BUGGY))
    # Each revisit is restored from a burst prompt saved over its slot: a marker of another tenant,
    # or of another request of its own tenant: either way another conversation's context, a leak
    # (a verdict the benign engine never earns: tests/probes/test_benign_engine.py).
    assert verdict is Verdict.LEAK, evidence
    revisits = [t for t in evidence["tenants"] if t["step"] == "revisit"]
    assert [t["reason"] for t in revisits] == ["restored_foreign_conversation"] * 2, evidence


def test_without_churn_or_plant_the_buggy_cache_still_holds_the_conversations(reference) -> None:  # type: ignore[no-untyped-def]
    # The defect needs the trigger: with no burst and no plant the ring never goes round.
    verdict, reason, evidence = run_kind("session", reference(*BUGGY), churn_tokens=0, plant_turns=0)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence


def test_a_conversation_restored_from_misfiled_offload_chunks_is_caught_by_the_plant_alone(reference) -> None:  # type: ignore[no-untyped-def]
    worker = reference(*OFFLOAD_BUG)
    # No burst: the plant's eight turns move the ring on, and the latest long sequence is a plant.
    verdict, _, evidence = run_kind("session", worker, churn_tokens=0)
    assert verdict is Verdict.LEAK, evidence
    revisits = [t for t in evidence["tenants"] if t["step"] == "revisit"]
    assert [t["reason"] for t in revisits] == ["restored_foreign_conversation"] * 2, evidence
    # Without the plant the latest sequences are canaries, whose markers lie past what is restored.
    verdict, _, evidence = run_kind("session", worker, churn_tokens=0, plant_turns=0)
    assert verdict is not Verdict.LEAK, evidence


def test_the_offload_tier_restores_conversations_the_ring_let_go_of(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = run_kind("session", reference(*CACHED), churn_tokens=0)
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
    revisits = [c for c in calls if c.chat and "What was the code" in c.prompt]
    assert len(revisits) == 2
    for call in revisits:
        user, _, question = call.body["messages"]
        assert [m["role"] for m in call.body["messages"]] == ["user", "assistant", "user"]
        assert (
            call.markers and call.markers[0] in user["content"] and "What was the code" in question["content"]
        )


def _session(fake: FakeEngine, **options: Any) -> tuple[Verdict, str, dict[str, Any]]:
    async def go() -> tuple[Verdict, str, dict[str, Any]]:
        async with fake.target(engine="vllm") as target:
            update = {"probes": ["session"], "options": {"session": {"repeats": True, **options}}}
            config = target._config.model_copy(update=update)
            result, _ = await execute_probe("session", target, MarkerBook(), config)
        return result.verdict, result.reason, result.evidence

    return asyncio.run(go())


class WrongContextEngine:
    """An engine that answers a caller resending a conversation it opened, after ``after`` or more
    other requests, with another caller's latest prompt of ``long`` characters or more."""

    def __init__(self, after: int = 8, long: int = 1024) -> None:
        self.after, self.long = after, long
        self.opened: dict[tuple[str, str], int] = {}  # (caller, first message) -> request number
        self.latest_long: dict[str, str] = {}  # caller -> its latest long prompt
        self.served = 0

    def __call__(self, call: Call) -> httpx.Response:
        number, self.served = self.served, self.served + 1
        opening = call.body["messages"][0]["content"] if call.chat else call.prompt
        opened = self.opened.setdefault((call.tenant, opening), number)
        if len(call.prompt) >= self.long:
            self.latest_long[call.tenant] = call.prompt
        others = [prompt for caller, prompt in self.latest_long.items() if caller != call.tenant]
        if number - opened >= self.after and len(call.body.get("messages", ())) > 1 and others:
            return answer(call, others[-1][: call.body["max_tokens"]])
        return FakeEngine.echo(call)


def test_a_revisit_answered_with_another_callers_latest_long_prompt_is_a_leak() -> None:
    # Without a burst (no pool published): the plant alone brings the eight requests and the
    # long, marked prompts such an engine hands over.
    verdict, reason, evidence = _session(FakeEngine(reply=WrongContextEngine(), info=None), churn_tokens=0)
    assert (verdict, reason) == (Verdict.LEAK, "foreign_marker"), evidence
    revisits = [t for t in evidence["tenants"] if t["step"] == "revisit"]
    assert [t["reason"] for t in revisits] == ["restored_foreign_conversation"] * 2, evidence
    assert {leak["owner_tenant"] for leak in evidence["leaks"]} == {"alice", "bob"}


def test_without_the_plant_such_an_engine_passes_unseen() -> None:
    # What every kind drew before: the revisit found no other tenant's long context to be handed.
    verdict, reason, evidence = _session(
        FakeEngine(reply=WrongContextEngine(), info=None), churn_tokens=0, plant_turns=0
    )
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence


def test_the_plant_interleaves_growing_marked_conversations_of_every_tenant() -> None:
    fake = FakeEngine()
    verdict, _, evidence = _session(fake, churn_tokens=0, plant_chars=1_024)
    assert verdict is Verdict.PASS, evidence
    plants = [c for c in fake.calls if c.chat and " note " in c.body["messages"][-1]["content"]]
    assert [c.tenant for c in plants] == ["alice", "bob"] * 4
    for turn, (mine, theirs) in enumerate(zip(plants[::2], plants[1::2], strict=True), start=1):
        for call in (mine, theirs):
            assert len(call.body["messages"]) == 2 * turn - 1  # the conversation so far, sent back
            note = call.body["messages"][-1]["content"]
            assert f" note {turn}, code KVC-" in note[:30] and call.markers[-1] in note[:70]
    assert 900 <= len(plants[-1].prompt) <= 1_024
    # Between each first turn and its revisit: the other first turn, two canaries, eight plant turns.
    opening = [
        (i, c) for i, c in enumerate(fake.calls) if c.chat and c.prompt.startswith("Remember this code for")
    ]
    firsts = [i for i, c in opening if len(c.body["messages"]) == 1]
    revisits = [i for i, c in enumerate(fake.calls) if c.chat and "What was the code" in c.prompt]
    assert min(revisits) - max(firsts) - 1 >= 8
