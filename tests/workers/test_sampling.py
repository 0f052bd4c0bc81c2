"""Per-request sampling parameters (stop strings, allowed tokens, thinking budgets), honoured by the
engine, and the ``sampling-rows-stale`` defect that reads them from another row's entry.

The engine is driven without its thread, step by step where the order of rows matters.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi.testclient import TestClient

from kvcanary.workers.engine import Engine
from kvcanary.workers.request import FinishEvent, SamplingParams, TokenEvent
from kvcanary.workers.sampling import stop_split
from tests.workers.support import Collector, complete, run_until_idle, small_config, submit

END = "</think>"
MARKER = "KVC-0123abcd-0123456789abcdef0123456789abcdef"
ALPHABET = frozenset(b"KVC-0123456789abcdef")


def fired(engine: Engine, bug: str) -> tuple[float | None, float | None]:
    registry = engine.metrics.registry
    return (
        registry.get_sample_value("kvcanary_bug_trigger_events_total", {"bug": bug}),
        registry.get_sample_value("kvcanary_bug_fired_total", {"bug": bug}),
    )


def test_an_answer_ends_before_its_first_stop_string_which_is_never_sent() -> None:
    engine = Engine(small_config())
    stopped = submit(
        engine, "one two <end> three <halt>", 100, "a", sampling=SamplingParams(stop=(b"<halt>", b"<end>"))
    )
    run_until_idle(engine)
    assert stopped.text == "one two "
    assert stopped.last == FinishEvent("stop", 26, len("one two <end>"))
    # No token of the stop string reached the client, not even while it could still have been text.
    assert b"<" not in bytes(e.token_id for e in stopped.events if isinstance(e, TokenEvent))


def test_a_held_back_tail_that_never_becomes_a_stop_string_is_sent() -> None:
    engine = Engine(small_config())
    almost = submit(engine, "a <en a <e", 100, "a", sampling=SamplingParams(stop=(b"<end>",)))
    run_until_idle(engine)
    assert almost.text == "a <en a <e" and almost.last == FinishEvent("stop", 10, 10)


def test_stop_split_holds_back_exactly_what_may_still_become_a_stop_string() -> None:
    assert stop_split(list(b"abc <st"), 0, (b"<stop>",)) == (4, False)
    assert stop_split(list(b"abc <stop> x"), 4, (b"<stop>",)) == (4, True)
    assert stop_split(list(b"abc <x"), 4, (b"<stop>",)) == (6, False)
    assert stop_split(list(b"ab"), 2, (b"b!", b"zz")) == (2, False)


def test_an_allowlist_limits_every_token_and_keeps_what_it_allows() -> None:
    engine = Engine(small_config())
    prompt = f"Remember this code: {MARKER} please"
    limited = submit(engine, prompt, 100, "a", sampling=SamplingParams(allowed=ALPHABET))
    run_until_idle(engine)
    assert set(limited.text.encode()) <= ALPHABET
    assert MARKER in limited.text  # its own characters are all allowed: the copy keeps them


def test_a_thinking_budget_forces_the_reasoning_end_string_once_it_runs_out() -> None:
    engine = Engine(small_config(reasoning_end_str=END))
    thinking = submit(engine, "x" * 40, 40, "a", sampling=SamplingParams(thinking_budget=10))
    plain = submit(engine, "y" * 40, 40, "b")
    run_until_idle(engine)
    assert thinking.text == "x" * 10 + END + "x" * 22
    assert plain.text == "y" * 40


def test_without_a_reasoning_end_string_a_thinking_budget_forces_nothing() -> None:
    engine = Engine(small_config())
    thinking = submit(engine, "x" * 40, 40, "a", sampling=SamplingParams(thinking_budget=10))
    run_until_idle(engine)
    assert thinking.text == "x" * 40


def test_the_http_api_honours_stop_strings_in_streams_and_refuses_tokens_outside_the_vocabulary(
    serve: Callable[..., TestClient],
) -> None:
    client = serve()
    streamed = complete(client, "alpha beta STOP gamma", max_tokens=50, stop="STOP", stream=True)
    blocks = [b.removeprefix("data: ") for b in streamed.text.split("\n\n") if b.startswith("data: {")]
    chunks = [json.loads(b) for b in blocks]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "alpha beta "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    limited = complete(client, "abcabc", max_tokens=6, allowed_token_ids=[ord("a"), ord("c")]).json()
    assert set(limited["choices"][0]["text"]) <= {"a", "c"}
    refused = complete(client, "abc", max_tokens=6, allowed_token_ids=[97, 300])
    assert refused.status_code == 400 and "allowed_token_ids" in refused.json()["error"]["message"]


def _moved_batch(bugs: frozenset[str]) -> tuple[Engine, Collector, Collector]:
    """Run a short request, then two long ones constrained their own way: the short one leaves after
    a few steps, and the last row (the allowlisted one) moves into its row. Return the engine, the
    stopping answer and the allowlisted one."""
    engine = Engine(small_config(max_batch=8, bugs=bugs, reasoning_end_str=END))
    submit(engine, "s" * 8, 8, "a", sampling=SamplingParams(thinking_budget=12))
    stop = SamplingParams(stop=(b"<stop-b>",))
    stopping = submit(engine, "b" * 30 + "<stop-b>" + "b" * 20, 60, "b", sampling=stop)
    limited = submit(engine, f"{MARKER} and then words", 80, "c", sampling=SamplingParams(allowed=ALPHABET))
    run_until_idle(engine)
    return engine, stopping, limited


def test_a_row_moved_into_a_freed_row_keeps_reading_its_own_slot() -> None:
    _, stopping, limited = _moved_batch(frozenset())
    assert set(limited.text.encode()) <= ALPHABET and MARKER in limited.text
    assert stopping.text == "b" * 30


def test_with_the_defect_a_moved_row_reads_the_entry_its_row_left_behind() -> None:
    engine, _, limited = _moved_batch(frozenset({"sampling-rows-stale"}))
    # Row 0's short request left with its thinking budget counting down; the allowlisted request,
    # moved into row 0, read that entry: no allowlist any more, and the end string forced in.
    assert END in limited.text and not set(limited.text.encode()) <= ALPHABET
    assert fired(engine, "sampling-rows-stale") == (1.0, 1.0)  # one request ran off its slot


def test_the_defect_acts_only_on_the_fraction_its_rate_draws() -> None:
    engine = Engine(small_config(max_batch=8, bugs=frozenset({"sampling-rows-stale"}), bug_rate=0.01))
    submit(engine, "s" * 8, 8, "a")
    limited = submit(engine, f"{MARKER} and then words", 80, "c", sampling=SamplingParams(allowed=ALPHABET))
    run_until_idle(engine)
    assert set(limited.text.encode()) <= ALPHABET
    assert fired(engine, "sampling-rows-stale") == (1.0, 0.0)
