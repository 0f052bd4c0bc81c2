"""The token-count invariant on every probe that sends a completion: usage.prompt_tokens far below
what was sent is a mismatch whatever the status code (the incident reported 1 for a huge prompt)."""

from __future__ import annotations

import httpx

from kvcanary.probes.base import Verdict, prompt_tokens_dropped
from tests.probes.probe_harness import Call, FakeEngine, answer, probe_once


def test_a_probe_that_passed_is_a_mismatch_when_usage_dropped_the_prompt() -> None:
    def dropped(call: Call) -> httpx.Response:
        # Answers look right (every plant and read comes back whole) but usage says one token.
        return answer(call, call.prompt[: call.body["max_tokens"]], prompt_tokens=1)

    engine = FakeEngine(reply=dropped)
    result = probe_once("cross_tenant", engine.target)
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "prompt_tokens_mismatch")
    dropped_ = result.evidence["dropped_prompts"]
    assert {d["prompt_tokens_reported"] for d in dropped_} == {1}
    assert len(dropped_) >= 4 and min(d["prompt_bytes"] for d in dropped_) > 64
    assert result.evidence["probe_verdict"] == "pass"


def test_honest_usage_leaves_the_verdict_alone() -> None:
    result = probe_once("cross_tenant", FakeEngine().target)
    assert (result.verdict, result.reason) == (Verdict.PASS, "no_foreign_marker")


def test_the_floor_without_a_tokenizer_count_is_conservative() -> None:
    # 4,096 bytes of ordinary text cannot be fewer than 128 tokens (32 bytes a token at most).
    assert prompt_tokens_dropped(None, 100, 4096) and not prompt_tokens_dropped(None, 128, 4096)
    # With the engine's own count, under half of it is dropped; a chat template only adds.
    assert prompt_tokens_dropped(1000, 499) and not prompt_tokens_dropped(1000, 1200)
    # Tiny prompts: only the incident's own signature, one token for a prompt, is certain.
    assert prompt_tokens_dropped(None, 1, 10) and not prompt_tokens_dropped(None, 2, 10)
    assert not prompt_tokens_dropped(None, None, 10**6)  # no usage: nothing to judge
