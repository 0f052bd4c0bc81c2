"""What the trigger kinds share (probes/triggers.py): judging an answer, and the lone canary's control."""

from __future__ import annotations

import asyncio
import time

from kvcanary.probes.base import ProbeContext, Verdict
from kvcanary.probes.canary import repeat_prompt
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import Completion, CompletionRequest
from kvcanary.probes.triggers import OWN_MARKER_HORIZON_CHARS, judge_own, model_repeats, own_marker_due
from tests.probes.probe_harness import Call, FakeEngine, answer, error

BOOK = MarkerBook()


def ok(text: str) -> Completion:
    return Completion(status=200, text=text, finish_reason="stop")


def asking(marker: str) -> CompletionRequest:
    """The canary's request for ``marker``: the marker within the first 96 characters sent."""
    return CompletionRequest(prompt=repeat_prompt(marker))


def judged(text: str, marker: str, repeats: bool | None) -> tuple[Verdict, str]:
    """Judge ``text`` as the answer to the canary's request for ``marker``: (verdict, reason)."""
    return judge_own(ok(text), asking(marker), marker, repeats, BOOK)[:2]


def test_a_copy_of_the_own_marker_in_another_case_is_judged_as_the_canary_judges_it() -> None:
    # Not another request's marker (it is this request's, lower-cased): the canary's own rule, an
    # exact copy, decides; a model that does not repeat passes.
    _, marker = BOOK.plant("t", "alice")
    assert judged(marker.lower(), marker, True) == (Verdict.MISMATCH, "nonce_missing")
    assert judged(marker.lower(), marker, False) == (Verdict.PASS, "no_foreign_marker")


def test_text_merely_shaped_like_a_marker_is_no_other_request_marker() -> None:
    # A sampled or penalised copy that got one digit wrong is not a marker anyone was given.
    _, marker = BOOK.plant("t", "alice")
    mangled = marker[:-1] + ("0" if marker[-1] != "0" else "1")
    assert judged(mangled, marker, False) == (Verdict.PASS, "no_foreign_marker")
    assert judged(mangled, marker, True) == (Verdict.MISMATCH, "nonce_missing")


def test_another_live_marker_of_the_same_tenant_is_a_mismatch_even_where_the_model_does_not_repeat() -> None:
    _, mine = BOOK.plant("t", "alice")
    _, earlier = BOOK.plant("t", "alice")
    for repeats in (True, False, None):
        verdict, reason, _ = judge_own(ok(f"{earlier} {mine}"), asking(mine), mine, repeats, BOOK)
        assert (verdict, reason) == (Verdict.MISMATCH, "other_request_marker"), repeats


def test_another_requests_marker_in_an_answer_cut_short_is_a_mismatch_and_in_a_5xx_no_evidence() -> None:
    _, mine = BOOK.plant("t", "alice")
    _, earlier = BOOK.plant("t", "alice")
    for kind in ("timeout", "stream"):  # a 200 whose answer stopped coming: what came is the engine's
        cut = Completion(status=200, text=f"{earlier} {earlier[:5]}", error_kind=kind, error="cut")
        verdict, reason, detail = judge_own(cut, asking(mine), mine, True, BOOK)
        assert (verdict, reason) == (Verdict.MISMATCH, "other_request_marker"), kind
        assert "characters read before it was cut short" in detail
    cut = Completion(status=200, text="the the", error_kind="timeout", error="cut")
    assert judge_own(cut, asking(mine), mine, True, BOOK)[0] is Verdict.ERROR  # nothing in it: no verdict
    failed = Completion(status=500, text=f"error while serving: {earlier}", error_kind="http", error="boom")
    assert judge_own(failed, asking(mine), mine, True, BOOK)[0] is Verdict.ERROR


def test_a_missing_own_marker_is_an_error_when_nobody_knows_whether_the_model_repeats() -> None:
    _, marker = BOOK.plant("t", "alice")
    assert judged("the the", marker, None) == (Verdict.ERROR, "repeats_unknown")


def test_a_lone_canary_without_an_answer_falls_back_on_the_last_answer_however_old() -> None:
    fake = FakeEngine(reply=lambda call: error(503, "overloaded"))

    async def go(state: dict[str, object]) -> bool | None:
        async with fake.target() as target:
            return await model_repeats(ProbeContext(target, MarkerBook(), {}, state=state))

    old = {"repeats": False, "repeats_checked_at": time.time() - 86_400}
    assert asyncio.run(go(old)) is False
    assert asyncio.run(go({})) is None


def test_a_lone_canary_answered_with_a_live_marker_of_another_request_shows_a_model_that_repeats() -> None:
    book = MarkerBook()
    _, stale = book.plant("ref", "alice")

    def stale_answer(call: Call):  # type: ignore[no-untyped-def]
        return answer(call, f"here: {stale}")

    fake = FakeEngine(reply=stale_answer)

    async def go() -> bool | None:
        async with fake.target() as target:
            return await model_repeats(ProbeContext(target, book, {}, state={}))

    assert asyncio.run(go()) is True


def test_an_own_marker_past_the_first_characters_sent_is_not_judged_but_a_foreign_one_is() -> None:
    # After a shared prefix a copy model reaches the marker only after hundreds of tokens of
    # verbatim copy, past where benign nondeterminism lets greedy answers drift: no evidence.
    _, mine = BOOK.plant("t", "alice")
    late = CompletionRequest(prompt=f"{'x' * 300}\nRemember this code: {mine}\nRepeat the code.")
    verdict, reason, detail = judge_own(ok("x" * 120 + " drifted words"), late, mine, True, BOOK)
    assert (verdict, reason) == (Verdict.PASS, "no_foreign_marker")
    assert f"past the first {OWN_MARKER_HORIZON_CHARS} characters" in detail
    _, earlier = BOOK.plant("t", "alice")
    verdict, reason, _ = judge_own(ok(f"x {earlier}"), late, mine, True, BOOK)
    assert (verdict, reason) == (Verdict.MISMATCH, "other_request_marker")


def test_an_own_marker_the_request_does_not_ask_for_is_not_judged() -> None:
    _, mine = BOOK.plant("t", "alice")
    request = CompletionRequest(prompt=f"Remember this code for later: {mine}\nSay OK.")
    verdict, _, detail = judge_own(ok("OK"), request, mine, True, BOOK, asked=False)
    assert verdict is Verdict.PASS and "does not ask for it back" in detail
    assert judge_own(ok("OK"), request, mine, True, BOOK)[:2] == (Verdict.MISMATCH, "nonce_missing")


def test_a_marker_is_due_by_where_it_ends_in_the_system_message_turns_and_prompt_in_that_order() -> None:
    _, mine = BOOK.plant("t", "alice")
    assert own_marker_due(CompletionRequest(prompt="q", system=f"Your code is {mine}."), mine)
    history = (("user", f"Remember this code for later: {mine}"), ("assistant", "OK"))
    assert own_marker_due(CompletionRequest(prompt="What was the code?", history=history), mine)
    # A long system message pushes a history's marker past the horizon.
    assert not own_marker_due(CompletionRequest(prompt="q", system="s" * 90, history=history), mine)
    assert not own_marker_due(CompletionRequest(prompt="no marker here"), mine)
