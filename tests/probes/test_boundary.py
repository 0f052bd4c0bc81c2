"""The boundary probe: against the reference worker as a process, and a scripted engine at the seam."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.boundary import MAX_TOKENS, BoundaryProbe, filler, over_margin
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import (
    CLEAN,
    PLACEHOLDER,
    Call,
    FakeEngine,
    Reference,
    answer,
    error,
    probe_once,
    run_probe,
)

LIMIT = 1023  # the workers' max_req_input_len: min(context 8192, prefill pool 1024) - 1
OVER_LIMIT = "Input length ({n} tokens) exceeds the maximum allowed length ({limit} tokens)."

# --- against the reference worker ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", CLEAN)
def test_it_passes_when_a_clean_worker_refuses_a_prompt_just_over_its_pool(
    shared_reference, mode: str
) -> None:
    result = probe_once("boundary", shared_reference(mode).target)
    assert (result.verdict, result.reason) == (Verdict.PASS, "refused_over_capacity"), result.detail
    m = result.measurements
    assert (m["status_code"], m["admission_limit"]) == (400, LIMIT)
    assert LIMIT + 1 <= m["prompt_tokens_sent"] <= LIMIT + 8
    assert "exceeds the maximum allowed length" in result.evidence["message"]
    assert result.evidence["token_count"] == "tokenizer"


def test_the_defective_node_serves_the_primed_tenants_pages_to_the_over_capacity_request(
    shared_reference,
) -> None:
    # Bob primes, alice overflows: the priming pages cover the whole stale read, so the worker's
    # earlier history does not matter.
    result = probe_once("boundary", shared_reference("disaggregated-placeholder").target)
    assert (result.verdict, result.reason) == (Verdict.LEAK, "foreign_marker"), result.detail
    assert result.evidence["probe_verdict"] == "mismatch"
    assert {(leak["owner_tenant"], leak["reader_tenant"]) for leak in result.evidence["leaks"]} == {
        ("bob", "alice")
    }
    m = result.measurements
    assert (m["status_code"], m["prompt_tokens_reported"]) == (200, 1)  # the incident's signature
    assert m["prompt_tokens_sent"] > LIMIT
    prime = result.evidence["prime"]
    assert (prime["tenant"], prime["status_code"]) == ("bob", 200) and prime["prompt_tokens"] < LIMIT


def test_the_defective_node_accepting_an_over_capacity_prompt_is_a_mismatch_without_a_leak(
    shared_reference,
) -> None:
    # Alone on the target, alice has no one to prime as; no marker of this run's book is in the
    # stale pages, so the 200 is a mismatch and nothing more.
    result = probe_once("boundary", lambda: shared_reference("disaggregated-placeholder").target("alice"))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "accepted_over_capacity")
    assert result.evidence["prime"] is None
    assert "reported 1 prompt tokens" in result.detail


def test_zeroed_free_pages_leave_a_mismatch_but_no_leak(reference) -> None:
    result = probe_once("boundary", reference(*PLACEHOLDER, "--zero-freed-pages").target)
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "accepted_over_capacity")
    assert result.evidence["prime"]["status_code"] == 200


def test_verified_page_ownership_turns_the_leak_into_an_error_not_a_leak(reference) -> None:
    result = probe_once("boundary", reference(*PLACEHOLDER, "--verify-ownership").target)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "server_error")
    assert result.measurements["status_code"] == 500
    assert "ownership" in result.evidence["message"]


def test_it_reports_an_error_not_a_leak_when_the_port_is_unreachable(unreachable: Reference) -> None:
    result = probe_once("boundary", unreachable.target)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "capacity_unknown")


# --- judgment, with a scripted engine -------------------------------------------------------------------


def refuse_over(limit: int, tokens=lambda call: len(call.prompt.encode())):
    def reply(call: Call) -> httpx.Response:
        n = tokens(call)
        if n > limit:
            return error(400, OVER_LIMIT.format(n=n, limit=limit))
        return answer(call, call.prompt[:1], prompt_tokens=n)

    return reply


def run_fake(engine: FakeEngine, *, target_engine="reference", book=None, target_options=None, **options):
    async def go() -> ProbeResult:
        async with engine.target(engine=target_engine, **(target_options or {})) as target:
            return await run_probe("boundary", target, book or MarkerBook(), **options)

    return asyncio.run(go())


def test_a_refusal_passes_once_a_small_control_prompt_is_accepted_after_it() -> None:
    engine = FakeEngine(refuse_over(LIMIT))
    result = run_fake(engine)
    assert (result.verdict, result.reason) == (Verdict.PASS, "refused_over_capacity")
    prime, big, control = engine.calls
    assert (prime.tenant, big.tenant, control.tenant) == ("bob", "alice", "alice")
    assert (big.path, big.body["stream"], big.body["max_tokens"]) == ("/v1/completions", False, MAX_TOKENS)
    assert len(big.prompt) == result.measurements["prompt_tokens_sent"]
    assert LIMIT + 1 <= len(big.prompt) <= LIMIT + over_margin(16)
    assert big.markers and big.markers[0] in control.prompt  # the prober's own marker, in both
    assert control.body["max_tokens"] == 1 and len(control.prompt) < LIMIT


def test_the_priming_prompt_is_under_the_limit_and_asks_enough_to_cover_the_stale_read() -> None:
    engine = FakeEngine(refuse_over(LIMIT))
    run_fake(engine)
    prime, big, _ = engine.calls
    assert (prime.path, prime.body["stream"], len(prime.prompt)) == ("/v1/completions", False, LIMIT - 64)
    # An echoing decode writes prompt + max_tokens positions: at least what the big request reserves.
    assert len(prime.prompt) + prime.body["max_tokens"] >= len(big.prompt) + MAX_TOKENS
    assert prime.markers and not set(prime.markers) & set(big.markers)


def test_the_priming_prompt_and_its_generation_fit_an_engine_that_counts_both_against_the_context() -> None:
    def vllm_like(call: Call) -> httpx.Response:
        n = len(call.prompt)
        if n + call.body["max_tokens"] > 2000:
            return error(
                400, f"You passed {n} input tokens and requested {call.body['max_tokens']} output tokens"
            )
        return answer(call, "ok")

    engine = FakeEngine(vllm_like, info={"context_length": 2000, "max_total_num_tokens": 100_000})
    result = run_fake(engine)
    assert result.verdict is Verdict.PASS
    assert result.evidence["prime"]["status_code"] == 200


def test_no_priming_request_is_sent_when_priming_is_off_or_no_other_tenant_exists() -> None:
    off = FakeEngine(refuse_over(LIMIT))
    assert run_fake(off, prime=False).evidence["prime"] is None
    alone = FakeEngine(refuse_over(LIMIT))

    async def go() -> ProbeResult:
        async with alone.target(("alice",)) as target:
            return await run_probe("boundary", target)

    assert asyncio.run(go()).evidence["prime"] is None
    assert [c.tenant for c in off.calls + alone.calls] == ["alice"] * 4


def test_the_probing_tenant_is_chosen_by_option_and_the_next_one_primes() -> None:
    engine = FakeEngine(refuse_over(LIMIT))
    run_fake(engine, tenant="bob")
    assert [c.tenant for c in engine.calls] == ["alice", "bob", "bob"]


def test_a_refusal_proves_nothing_when_the_small_control_prompt_is_refused_too() -> None:
    result = run_fake(FakeEngine(lambda call: error(400, "bad request")))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "control_failed")


def test_a_200_over_capacity_is_a_mismatch_with_the_prompt_tokens_reported_beside_those_sent() -> None:
    result = run_fake(FakeEngine(lambda call: answer(call, "\x00garbage", prompt_tokens=1)))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "accepted_over_capacity")
    m = result.measurements
    assert (m["status_code"], m["prompt_tokens_reported"], m["admission_limit"]) == (200, 1, LIMIT)
    assert result.evidence["excerpt"] == "\x00garbage"


def test_a_200_carrying_another_tenants_live_marker_is_a_leak() -> None:
    book = MarkerBook()
    _, bobs = book.plant("ref", "bob")
    result = run_fake(FakeEngine(lambda call: answer(call, f"stale: {bobs} ...", prompt_tokens=1)), book=book)
    assert (result.verdict, result.evidence["probe_verdict"]) == (Verdict.LEAK, "mismatch")
    assert result.evidence["leaks"][0]["owner_tenant"] == "bob"
    assert bobs not in repr(result)
    assert result.reason == "foreign_marker" and "the probe also found: HTTP 200" in result.detail


@pytest.mark.parametrize(
    ("status", "reason"), [(500, "server_error"), (401, "auth_failed"), (429, "rate_limited")]
)
def test_answers_it_cannot_judge_are_errors(status: int, reason: str) -> None:
    result = run_fake(FakeEngine(lambda call: error(status, "no")))
    assert (result.verdict, result.reason) == (Verdict.ERROR, reason)


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (413, b"<html>413 Request Entity Too Large</html>", "foreign_answer"),  # nginx's body limit
        (307, b"", "foreign_answer"),
        (408, b"<html>timeout</html>", "foreign_answer"),
        (404, b'{"error": {"message": "no such model", "code": 404}}', "refused"),
    ],
)
def test_an_answer_from_in_front_of_the_engine_is_an_error_never_a_pass(
    status: int, body: bytes, reason: str
) -> None:
    def reply(call: Call) -> httpx.Response:
        if len(call.prompt) > LIMIT:
            return httpx.Response(status, content=body)
        return answer(call, "ok")

    result = run_fake(FakeEngine(reply))
    assert (result.verdict, result.reason) == (Verdict.ERROR, reason)


def test_a_200_whose_body_is_broken_is_an_error_not_an_acceptance() -> None:
    def reply(call: Call) -> httpx.Response:
        if len(call.prompt) > LIMIT:
            return httpx.Response(200, content=b"not json at all")
        return answer(call, "ok")

    result = run_fake(FakeEngine(reply))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "protocol")


def test_unknown_capacity_is_an_error_and_nothing_is_sent() -> None:
    engine = FakeEngine(info=None)
    result = run_fake(engine)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "capacity_unknown")
    assert engine.calls == []


def test_a_limit_over_max_prompt_tokens_is_an_error_and_nothing_is_sent() -> None:
    engine = FakeEngine(info={"context_length": 1_048_576, "max_total_num_tokens": 2_040_000})
    result = run_fake(engine, max_prompt_tokens=1_000_000)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "prompt_too_large")
    assert engine.calls == []


def test_capacity_stated_in_the_target_options_is_probed_when_the_engine_states_none() -> None:
    engine = FakeEngine(refuse_over(300), info=None)
    result = run_fake(engine, target_options={"context_window": 300})
    assert result.verdict is Verdict.PASS
    assert 301 <= result.measurements["prompt_tokens_sent"] <= 308


def test_a_tokenizer_that_is_not_linear_is_followed_until_the_prompt_is_just_over() -> None:
    def bpe_like(text: str) -> int:
        return 1 + len(text) // 3 + len(text) // 700  # a BOS token and a drifting rate

    engine = FakeEngine(
        refuse_over(5000, lambda call: bpe_like(call.prompt)),
        count=bpe_like,
        info={"context_length": 5000, "max_total_num_tokens": 9000, "page_size": 4},
    )
    result = run_fake(engine)
    assert result.verdict is Verdict.PASS
    prime, big, _ = engine.calls
    assert 5001 <= bpe_like(big.prompt) <= 5004  # within one page of 4 tokens
    assert result.measurements["prompt_tokens_sent"] == bpe_like(big.prompt)
    assert bpe_like(prime.prompt) <= 5000 - 64 + 2  # the priming prompt stays under the limit


def test_without_a_tokenizer_tokens_are_estimated_from_usage_with_a_safety_margin() -> None:
    def four_per_token(call: Call) -> int:
        return 1 + math.ceil(len(call.prompt) / 4)

    engine = FakeEngine(refuse_over(4000, four_per_token), tokenize=False)
    result = run_fake(engine, target_engine="openai", target_options={"context_window": 4000})
    assert (result.verdict, result.evidence["token_count"]) == (Verdict.PASS, "usage_estimate")
    small, big, prime, large = engine.calls
    assert small.body["max_tokens"] == big.body["max_tokens"] == 1
    assert 4001 <= four_per_token(large) <= 4001 + 20 + 2  # margin: the larger of 8 and 0.5% of 4000
    assert (prime.tenant, four_per_token(prime) <= 4000 - 64 + 2) == ("bob", True)


def test_without_a_tokenizer_or_usage_it_cannot_size_a_prompt() -> None:
    no_usage = httpx.Response(200, json={"choices": [{"text": "x", "finish_reason": "stop"}]})
    result = run_fake(
        FakeEngine(lambda call: no_usage, tokenize=False),
        target_engine="openai",
        target_options={"context_window": 4000},
    )
    assert (result.verdict, result.reason) == (Verdict.ERROR, "calibration_failed")


def test_the_overshoot_stays_within_eight_tokens_and_one_page() -> None:
    assert (over_margin(None), over_margin(1), over_margin(4), over_margin(64)) == (8, 1, 4, 8)


def test_filler_is_exactly_as_long_as_asked_and_repeats_the_marker() -> None:
    marker = "KVC-0123abcd-" + "e" * 32
    text = filler(marker, 100_000)
    assert len(text) == 100_000 and text.count(marker) > 800 and text.startswith(marker)


def test_the_boundary_probe_runs_every_five_minutes_by_default() -> None:
    assert (BoundaryProbe.kind, BoundaryProbe.default_interval_seconds) == ("boundary", 300.0)
