"""The needle probe: against the reference worker as a process, and a scripted engine at the seam."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.boundary import MAX_SIZING_ROUNDS
from kvcanary.probes.markers import MARKER_RE, MarkerBook
from kvcanary.probes.needle import MAX_TOKENS, QUESTION, TEMPLATE_HEADROOM, NeedleProbe, filler, tolerance
from tests.probes.probe_harness import (
    CLEAN,
    KEYS,
    TENANTS,
    Call,
    FakeEngine,
    Reference,
    answer,
    error,
    target_config,
)

LIMIT = 1023  # the workers' max_req_input_len: min(context 8192, prefill pool 1024) - 1
TARGET = LIMIT - MAX_TOKENS - TEMPLATE_HEADROOM


def run_needle(
    target: OpenAIHttpTarget,
    book: MarkerBook | None = None,
    state: dict[str, Any] | None = None,
    **options: Any,
) -> ProbeResult:
    """Run the needle once, as the runner would (judged), with ``state`` from a previous run; close
    the target (its HTTP session left open would be reported unclosed in some later test's loop)."""
    ctx = ProbeContext(target, book if book is not None else MarkerBook(), options, state=state)

    async def go() -> ProbeResult:
        async with target:
            return await NeedleProbe().run(ctx)

    return asyncio.run(go())


def run_fake(engine: FakeEngine, *, tenants=("alice", "bob"), target_options=None, **options) -> ProbeResult:
    async def go() -> ProbeResult:
        async with engine.target(tenants, **(target_options or {})) as target:
            ctx = ProbeContext(target, MarkerBook(), options)
            return await NeedleProbe().run(ctx)

    return asyncio.run(go())


def needle_calls(engine: FakeEngine) -> list[Call]:
    """Return the calls that carried the needle itself (the long, non-control requests)."""
    return [c for c in engine.calls if c.body["max_tokens"] != 1]


# --- against the reference worker ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", CLEAN)
def test_it_passes_when_a_clean_worker_reads_the_nonce_back_from_the_start_of_a_full_prompt(
    shared_reference, mode: str
) -> None:
    async def go() -> ProbeResult:
        async with shared_reference(mode).target() as target:
            return await NeedleProbe().run(ProbeContext(target, MarkerBook(), {}))

    result = asyncio.run(go())
    assert (result.verdict, result.reason) == (Verdict.PASS, "needle_found"), result.detail
    m = result.measurements
    assert (m["status_code"], m["admission_limit"], m["prompt_tokens_target"]) == (200, LIMIT, TARGET)
    # Byte tokens: /tokenize and usage agree exactly, and the template of one message adds nothing.
    assert TARGET - tolerance(TARGET) <= m["prompt_tokens_sent"] <= TARGET
    assert m["prompt_tokens_reported"] == m["prompt_tokens_sent"]
    assert result.evidence["token_count"] == "tokenizer"
    assert result.state == {"next_tenant": 1}


def test_a_node_that_overstates_its_pool_loses_the_needle_to_the_placeholder_defect(shared_reference) -> None:
    # The operator states a 4,096-token pool for a node whose prefill pool holds 1,024: the needle
    # fits the stated pool, the defective node swaps it for one placeholder token and decodes over
    # pages it never received (the incident, inside the capacity the node was believed to have).
    url = shared_reference("disaggregated-placeholder").url
    config = target_config(url, TENANTS, kv_pool_tokens=4096, max_req_input_len=4096)
    result = run_needle(OpenAIHttpTarget(config, {t: KEYS[t] for t in TENANTS}))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "needle_lost"), result.detail
    m = result.measurements
    assert (m["status_code"], m["prompt_tokens_reported"]) == (200, 1)
    assert 4096 - MAX_TOKENS - TEMPLATE_HEADROOM - 20 <= m["prompt_tokens_sent"] <= 4096


def test_it_reports_an_error_not_a_failure_when_the_port_is_unreachable(unreachable: Reference) -> None:
    with_limit = run_needle(unreachable.target())
    assert (with_limit.verdict, with_limit.reason) == (Verdict.ERROR, "capacity_unknown")
    sized = run_needle(unreachable.target(), prompt_tokens=500)
    assert sized.verdict is Verdict.ERROR and not sized.verdict.is_failure


# --- judgment, with a scripted engine -------------------------------------------------------------------


def test_the_prompt_is_nonce_first_question_last_with_marker_free_filler_in_a_greedy_chat() -> None:
    engine = FakeEngine()
    result = run_fake(engine)
    assert result.verdict is Verdict.PASS
    (call,) = needle_calls(engine)
    (marker,) = call.markers  # the filler holds none
    assert call.prompt.startswith(marker) and call.prompt.endswith(QUESTION)
    assert not MARKER_RE.search(filler(100_000)) and "KVC-" not in filler(100_000)
    body = call.body
    assert (call.chat, body["stream"], body["temperature"], body["max_tokens"]) == (True, False, 0.0, 96)


def test_sizing_stays_under_the_admission_limit_and_close_to_the_target_with_a_bpe_like_tokenizer() -> None:
    info = {"context_length": 200_000, "max_total_num_tokens": 120_000, "page_size": 16}

    def count(text: str) -> int:
        return 1 + len(text.encode()) // 4 + text.count(" ") // 3  # words and bytes, like BPE

    engine = FakeEngine(lambda call: answer(call, call.markers[0], prompt_tokens=count(call.prompt)))
    engine.info, engine.count = info, count
    result = run_fake(engine)
    assert result.verdict is Verdict.PASS, result.detail
    target = 120_000 - MAX_TOKENS - TEMPLATE_HEADROOM
    (call,) = needle_calls(engine)
    sent = count(call.prompt)
    assert sent == result.measurements["prompt_tokens_sent"]
    assert target - tolerance(target) <= sent <= target
    assert sent + call.body["max_tokens"] < 120_000


def test_fraction_and_prompt_tokens_shrink_the_needle() -> None:
    half = FakeEngine()
    assert run_fake(half, fraction=0.5).measurements["prompt_tokens_target"] == 511 - 96 - 64
    capped = FakeEngine()
    result = run_fake(capped, prompt_tokens=400)
    assert result.measurements["prompt_tokens_target"] == 400
    assert 400 - tolerance(400) <= len(needle_calls(capped)[0].prompt) <= 400


def test_a_node_too_small_for_a_needle_is_an_error() -> None:
    engine = FakeEngine(info={"context_length": 300, "max_total_num_tokens": 300})
    result = run_fake(engine)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "capacity_too_small")
    assert not engine.calls


def test_an_engine_that_drops_the_start_of_long_prompts_loses_the_needle() -> None:
    def truncate(call: Call) -> httpx.Response:
        kept = call.prompt[-512:]  # silent truncation from the front, the nonce with it
        return answer(call, kept[: call.body["max_tokens"]], prompt_tokens=len(kept))

    result = run_fake(FakeEngine(truncate))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "needle_lost")
    assert result.measurements["status_code"] == 200
    assert "did not come back" in result.detail and result.evidence["excerpt"]


def test_prompt_tokens_far_below_what_was_sent_are_a_mismatch_even_with_the_nonce_back() -> None:
    # The incident's signature: usage.prompt_tokens = 1 whatever the prompt.
    result = run_fake(FakeEngine(lambda call: answer(call, call.markers[0], prompt_tokens=1)))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "prompt_tokens_mismatch")
    assert result.measurements["prompt_tokens_reported"] == 1


def refuse_over(chars: int):
    def reply(call: Call) -> httpx.Response:
        if len(call.prompt) > chars:
            return error(
                400, f"The input ({len(call.prompt)} tokens) is longer than the model's context length."
            )
        return FakeEngine.echo(call)

    return reply


def test_refusing_a_counted_prompt_inside_the_stated_capacity_is_a_mismatch() -> None:
    engine = FakeEngine(refuse_over(800))
    result = run_fake(engine)
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "refused_within_capacity")
    assert result.measurements["status_code"] == 400
    big, control = engine.calls
    assert len(big.prompt) <= TARGET and control.body["max_tokens"] == 1 and len(control.prompt) < 800


def test_a_refusal_proves_nothing_when_the_small_control_prompt_is_refused_too() -> None:
    result = run_fake(FakeEngine(lambda call: error(400, "bad request")))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "control_failed")


def test_without_a_tokenizer_the_size_is_estimated_under_the_limit_and_a_refusal_is_not_judged() -> None:
    estimated = FakeEngine(tokenize=False)
    result = run_fake(estimated)
    assert (result.verdict, result.evidence["token_count"]) == (Verdict.PASS, "usage_estimate")
    first, second, big = estimated.calls  # two calibration requests, then the needle
    assert first.body["max_tokens"] == second.body["max_tokens"] == 1
    assert TARGET - 16 <= len(big.prompt) <= TARGET

    refused = run_fake(FakeEngine(refuse_over(800), tokenize=False))
    assert (refused.verdict, refused.reason) == (Verdict.ERROR, "refused")
    assert "estimated, not counted" in refused.detail


@pytest.mark.parametrize(
    ("status", "reason"), [(500, "server_error"), (503, "server_error"), (429, "rate_limited")]
)
def test_answers_it_cannot_judge_are_errors(status: int, reason: str) -> None:
    result = run_fake(FakeEngine(lambda call: error(status, "no")))
    assert (result.verdict, result.reason) == (Verdict.ERROR, reason)


def test_sizing_gives_up_with_an_error_when_the_tokenizer_never_lets_it_under_the_target() -> None:
    calls = []

    def count(text: str) -> int:
        calls.append(text)
        return 5 if len(calls) == 1 else 10**9  # a sample that looks tiny, then everything huge

    engine = FakeEngine(count=count)
    result = run_fake(engine)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "sizing_failed")
    assert len(calls) == 1 + MAX_SIZING_ROUNDS and not engine.calls


def test_each_run_asks_as_the_next_tenant_unless_one_is_pinned() -> None:
    engine = FakeEngine()
    state: dict[str, Any] = {}

    async def go() -> None:
        nonlocal state
        async with engine.target() as target:
            for _ in range(3):
                result = await NeedleProbe().run(ProbeContext(target, MarkerBook(), {}, state=state))
                state = result.state or state

    asyncio.run(go())
    assert [c.tenant for c in engine.calls] == ["alice", "bob", "alice"]
    pinned = FakeEngine()
    run_fake(pinned, tenant="bob")
    assert [c.tenant for c in pinned.calls] == ["bob"]


def test_another_tenants_marker_in_the_answer_is_a_leak() -> None:
    book = MarkerBook()
    _, bobs = book.plant("ref", "bob")

    async def go() -> ProbeResult:
        engine = FakeEngine(lambda call: answer(call, f"{call.markers[0]} and {bobs}"))
        async with engine.target() as target:
            return await NeedleProbe().run(ProbeContext(target, book, {"tenant": "alice"}))

    result = asyncio.run(go())
    assert (result.verdict, result.evidence["probe_verdict"]) == (Verdict.LEAK, "pass")
    assert bobs not in repr(result)


def test_the_probe_kind_is_needle_and_it_runs_every_ten_minutes() -> None:
    assert (NeedleProbe.kind, NeedleProbe.default_interval_seconds, NeedleProbe.scope) == (
        "needle",
        600.0,
        "target",
    )


def test_the_config_refuses_bad_needle_options(monkeypatch) -> None:
    monkeypatch.setitem(REGISTRY, "needle", NeedleProbe)
    base = {
        "name": "ref",
        "base_url": "http://engine.test",
        "tenants": [{"name": "alice"}],
        "probes": ["needle"],
    }
    for bad in ({"fraction": 0}, {"fraction": 1.5}, {"prompt_tokens": 0}, {"max_token": 9}):
        with pytest.raises(ValidationError):
            TargetConfig(**base, options={"needle": bad})
    config = TargetConfig(**base, options={"needle": {"fraction": 0.5, "chat": False}})
    assert config.options == {"needle": {"fraction": 0.5, "chat": False}}
