"""What the trigger kinds share (probes/triggers.py): judging an answer, and the lone canary's control."""

from __future__ import annotations

import asyncio
import time

from probes.base import ProbeContext, Verdict
from probes.markers import MarkerBook
from probes.target import Completion
from probes.triggers import judge_own, model_repeats
from tests.probes.probe_harness import Call, FakeEngine, answer, error

BOOK = MarkerBook()


def ok(text: str) -> Completion:
    return Completion(status=200, text=text, finish_reason="stop")


def test_a_copy_of_the_own_marker_in_another_case_is_judged_as_the_canary_judges_it() -> None:
    # Not another request's marker (it is this request's, lower-cased): the canary's own rule, an
    # exact copy, decides; a model that does not repeat passes.
    _, marker = BOOK.plant("t", "alice")
    assert judge_own(ok(marker.lower()), "p", marker, True, BOOK)[:2] == (Verdict.MISMATCH, "nonce_missing")
    assert judge_own(ok(marker.lower()), "p", marker, False, BOOK)[:2] == (Verdict.PASS, "no_foreign_marker")


def test_text_merely_shaped_like_a_marker_is_no_other_request_marker() -> None:
    # A sampled or penalised copy that got one digit wrong is not a marker anyone was given.
    _, marker = BOOK.plant("t", "alice")
    mangled = marker[:-1] + ("0" if marker[-1] != "0" else "1")
    assert judge_own(ok(mangled), "p", marker, False, BOOK)[:2] == (Verdict.PASS, "no_foreign_marker")
    assert judge_own(ok(mangled), "p", marker, True, BOOK)[:2] == (Verdict.MISMATCH, "nonce_missing")


def test_another_live_marker_of_the_same_tenant_is_a_mismatch_even_where_the_model_does_not_repeat() -> None:
    _, mine = BOOK.plant("t", "alice")
    _, earlier = BOOK.plant("t", "alice")
    for repeats in (True, False, None):
        verdict, reason, _ = judge_own(ok(f"{earlier} {mine}"), "p", mine, repeats, BOOK)
        assert (verdict, reason) == (Verdict.MISMATCH, "other_request_marker"), repeats


def test_a_missing_own_marker_is_an_error_when_nobody_knows_whether_the_model_repeats() -> None:
    _, marker = BOOK.plant("t", "alice")
    assert judge_own(ok("the the"), "p", marker, None, BOOK)[:2] == (Verdict.ERROR, "repeats_unknown")


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
