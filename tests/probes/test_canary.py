"""The canary probe: against the reference worker as a process, and a scripted engine at the seam."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.canary import CanaryProbe, prompt_tokens_dropped
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

# --- against the reference worker ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", CLEAN)
def test_it_passes_when_every_tenant_gets_its_nonce_back_from_a_clean_worker(
    shared_reference, mode: str
) -> None:
    worker = shared_reference(mode)
    result = probe_once("canary", worker.target)
    assert (result.verdict, result.reason) == (Verdict.PASS, "nonce_intact"), result.detail
    assert result.measurements["tenants_checked"] == result.measurements["tenants_passed"] == 2
    # Byte tokens: the worker's /tokenize count and its usage agree exactly.
    assert result.measurements["prompt_tokens_sent"] == result.measurements["prompt_tokens_reported"] == 90
    assert 0 < result.measurements["ttft_seconds"] <= result.measurements["latency_seconds"]
    assert [t["status_code"] for t in result.evidence["tenants"]] == [200, 200]


def test_it_reports_an_error_not_a_leak_when_the_port_is_unreachable(unreachable: Reference) -> None:
    result = probe_once("canary", unreachable.target)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "unreachable")
    assert not result.verdict.is_failure


def test_a_canary_nonce_that_reaches_another_tenant_through_stale_pages_is_a_leak(reference) -> None:
    worker = reference(*PLACEHOLDER)
    book = MarkerBook()

    async def scene() -> tuple[ProbeResult, ProbeResult]:
        async with worker.target("bob") as as_bob, worker.target("alice", "bob") as both:
            canary = await run_probe("canary", as_bob, book)
            # Over capacity on the defective node, without priming: decode reads the pages bob's
            # canary just freed (a fresh node holds nothing else).
            boundary = await run_probe("boundary", both, book, prime=False)
        return canary, boundary

    canary, boundary = asyncio.run(scene())
    assert canary.verdict is Verdict.PASS
    assert (boundary.verdict, boundary.evidence["probe_verdict"]) == (Verdict.LEAK, "mismatch")
    leak = boundary.evidence["leaks"][0]
    assert (leak["owner_tenant"], leak["reader_tenant"]) == ("bob", "alice")
    assert leak["marker_id"] == canary.evidence["tenants"][0]["marker_id"]


# --- judgment, with a scripted engine -------------------------------------------------------------------


def run_fake(
    engine: FakeEngine, *, target_engine: str = "reference", book: MarkerBook | None = None
) -> ProbeResult:
    async def go() -> ProbeResult:
        async with engine.target(engine=target_engine) as target:
            return await run_probe("canary", target, book)

    return asyncio.run(go())


def test_a_200_without_the_nonce_is_a_mismatch_not_a_pass() -> None:
    result = run_fake(FakeEngine(lambda call: answer(call, "Sure! Here is the code you asked for.")))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "nonce_missing")
    assert result.measurements["status_code"] == 200
    assert "did not repeat the nonce" in result.detail


def test_a_nonce_with_one_wrong_character_is_a_mismatch() -> None:
    def garble(call: Call) -> httpx.Response:
        marker = call.markers[0]
        return answer(call, marker[:-1] + ("0" if marker[-1] != "0" else "1"))

    assert run_fake(FakeEngine(garble)).reason == "nonce_missing"


def test_prompt_tokens_far_below_what_was_sent_are_a_mismatch_even_with_the_nonce_intact() -> None:
    # The incident's signature: usage.prompt_tokens = 1 whatever the prompt.
    result = run_fake(FakeEngine(lambda call: answer(call, call.markers[0], prompt_tokens=1)))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "prompt_tokens_mismatch")
    assert (result.measurements["prompt_tokens_sent"], result.measurements["prompt_tokens_reported"]) == (
        90,
        1,
    )


def test_without_a_tokenizer_only_a_one_token_report_is_a_mismatch() -> None:
    for reported, verdict in ((1, Verdict.MISMATCH), (30, Verdict.PASS)):
        engine = FakeEngine(
            lambda call, n=reported: answer(call, call.markers[0], prompt_tokens=n), tokenize=False
        )
        assert run_fake(engine, target_engine="openai").verdict is verdict


def test_prompt_tokens_dropped_compares_the_report_with_the_count_sent() -> None:
    assert prompt_tokens_dropped(90, 44) and not prompt_tokens_dropped(90, 45)
    assert not prompt_tokens_dropped(90, None) and not prompt_tokens_dropped(None, 2)
    assert prompt_tokens_dropped(None, 1)


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (401, "auth_failed"),
        (403, "auth_failed"),
        (429, "rate_limited"),
        (500, "server_error"),
        (503, "server_error"),
        (400, "refused"),
        (404, "refused"),
    ],
)
def test_answers_it_cannot_judge_are_errors_never_failures(status: int, reason: str) -> None:
    result = run_fake(FakeEngine(lambda call: error(status, "no")))
    assert (result.verdict, result.reason) == (Verdict.ERROR, reason)
    assert result.measurements["status_code"] == status


def test_a_broken_stream_is_an_error_not_a_mismatch() -> None:
    cut = httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=b'data: {"choices": []}\n\n'
    )
    result = run_fake(FakeEngine(lambda call: cut))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "protocol")


def test_a_mismatch_outranks_an_error_and_every_tenant_is_in_the_evidence() -> None:
    def split(call: Call) -> httpx.Response:
        return error(503, "busy") if call.tenant == "alice" else answer(call, "no code here")

    result = run_fake(FakeEngine(split))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "nonce_missing")
    assert [(t["tenant"], t["reason"]) for t in result.evidence["tenants"]] == [
        ("alice", "server_error"),
        ("bob", "nonce_missing"),
    ]
    assert result.detail.startswith("bob:")


def test_another_tenants_nonce_in_an_answer_is_a_leak() -> None:
    seen: list[str] = []

    def leaky(call: Call) -> httpx.Response:
        # A KV cache that hands bob what alice asked for a moment ago.
        seen.append(call.prompt)
        return answer(call, "\n".join(seen))

    book = MarkerBook()
    result = run_fake(FakeEngine(leaky), book=book)
    assert (result.verdict, result.reason) == (Verdict.LEAK, "foreign_marker")
    assert result.evidence["probe_verdict"] == "pass"
    leak = result.evidence["leaks"][0]
    assert (leak["owner_tenant"], leak["reader_tenant"]) == ("alice", "bob")


def test_the_evidence_never_holds_a_raw_nonce() -> None:
    engine = FakeEngine(lambda call: answer(call, "almost: " + call.markers[0][:-2]))
    result = run_fake(engine)
    assert result.verdict is Verdict.MISMATCH
    text = repr(result)
    for call in engine.calls:
        secret = call.markers[0].rsplit("-", 1)[1]
        assert secret[:24] not in text
    assert not re.search(r"[0-9a-f]{24,}", re.sub(r"[0-9a-f]{64}", "", text))  # only SHA-256 digests


def test_every_run_plants_a_fresh_nonce_per_tenant_in_a_greedy_streamed_chat() -> None:
    engine = FakeEngine()
    book = MarkerBook()
    for _ in range(2):
        assert run_fake(engine, book=book).verdict is Verdict.PASS
    assert [c.tenant for c in engine.calls] == ["alice", "bob", "alice", "bob"]
    assert len({c.markers[0] for c in engine.calls}) == 4
    assert all(book.is_live(c.markers[0]) for c in engine.calls)
    body = engine.calls[0].body
    assert (body["temperature"], body["seed"], body["stream"], body["max_tokens"]) == (0.0, 0, True, 96)
    assert engine.calls[0].chat


def test_the_probe_kind_is_canary() -> None:
    assert CanaryProbe.kind == "canary"


def test_one_token_count_serves_every_tenant_and_later_runs_while_fresh() -> None:
    """Counting every canary prompt was a quarter of the monitor's CPU at scale; one count serves."""
    counted: list[str] = []
    engine = FakeEngine(count=lambda text: counted.append(text) or len(text.encode()))
    ctx_state: dict[str, object] = {}

    async def runs() -> list[ProbeResult]:
        out = []
        async with engine.target() as target:
            for _ in range(3):
                ctx = ProbeContext(target, MarkerBook(), {}, state=ctx_state)
                result = await CanaryProbe().run(ctx)
                if result.state is not None:
                    ctx_state.clear()
                    ctx_state.update(result.state)
                out.append(result)
        return out

    results = asyncio.run(runs())
    assert [r.verdict for r in results] == [Verdict.PASS] * 3
    assert len(counted) == 1  # one /tokenize for 2 tenants x 3 runs
    sent = [t["prompt_tokens_sent"] for r in results for t in r.evidence["tenants"]]
    assert sent == [len(counted[0].encode())] * 6
