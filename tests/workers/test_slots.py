"""Batch slots: a request takes the slot freed last, prefill reads its prompt from the slot's buffer,
and the ``slot-stale-tokens`` defect prefills a request that took a slot freed while the batch ran
from what the previous occupant left there.

The engine is driven without its thread, so that a request joins exactly when a slot was freed.
"""

from __future__ import annotations

from kvcanary.workers.engine import Engine
from kvcanary.workers.request import FinishEvent
from tests.workers.support import Collector, small_config, submit

PREVIOUS = "tenant A wrote this: ALPHA-SECRET-0451 "
BUSY = "b" * 400


def fired(engine: Engine) -> tuple[float | None, float | None]:
    registry, label = engine.metrics.registry, {"bug": "slot-stale-tokens"}
    return (
        registry.get_sample_value("kvcanary_bug_trigger_events_total", label),
        registry.get_sample_value("kvcanary_bug_fired_total", label),
    )


def step(engine: Engine, times: int = 1) -> None:
    for _ in range(times):
        engine.admit_waiting()
        if engine.batch:
            engine.decode_once()


def reuse(engine: Engine, *, drain_first: bool = False) -> tuple[Collector, Collector, list[int | None]]:
    """Run a busy request beside A until A finishes, then B into the slot A freed (after the batch
    drained, with ``drain_first``); return A's and B's answers and A's and B's slots."""
    if not drain_first:
        submit(engine, BUSY, 400, "busy")
    a = submit(engine, PREVIOUS, len(PREVIOUS), "a")
    step(engine)
    slots = [engine.batch.requests[-1].slot]
    step(engine, len(PREVIOUS) - 1)  # A's last token: it leaves, the busy row runs on
    assert isinstance(a.last, FinishEvent) and a.text == PREVIOUS
    b = submit(engine, "tenant B asks: what is my own text? " + "b" * 20, 60, "b")
    step(engine)
    slots.append(engine.batch.requests[-1].slot)
    while engine.batch or engine._waiting:
        step(engine)
    return a, b, slots


def test_a_request_takes_the_slot_freed_last_and_is_prefilled_with_its_own_prompt() -> None:
    engine = Engine(small_config(max_batch=8))
    _, b, (a_slot, b_slot) = reuse(engine)
    assert b.text == "tenant B asks: what is my own text? " + "b" * 20
    assert a_slot == b_slot == 1  # the busy row holds slot 0


def test_with_the_defect_the_next_occupant_is_prefilled_with_the_previous_ones_tokens() -> None:
    engine = Engine(small_config(max_batch=8, bugs=frozenset({"slot-stale-tokens"})))
    _, b, _ = reuse(engine)
    # B's first positions hold A's prompt (and A's answer after it): a copy of them comes back.
    assert b.text.startswith(PREVIOUS) and "ALPHA-SECRET-0451" in b.text
    assert fired(engine) == (1.0, 1.0)


def test_a_slot_taken_after_the_batch_drained_is_written_before_prefill_reads_it() -> None:
    engine = Engine(small_config(max_batch=8, bugs=frozenset({"slot-stale-tokens"})))
    _, b, _ = reuse(engine, drain_first=True)  # nothing ran beside A: the pipeline emptied
    assert "ALPHA" not in b.text
    assert fired(engine) == (0.0, 0.0)


def test_the_defect_acts_only_on_the_fraction_its_rate_draws() -> None:
    engine = Engine(small_config(max_batch=8, bugs=frozenset({"slot-stale-tokens"}), bug_rate=0.01))
    _, b, _ = reuse(engine)
    assert "ALPHA" not in b.text
    assert fired(engine) == (1.0, 0.0)
