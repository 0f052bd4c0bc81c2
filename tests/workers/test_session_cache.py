"""The session cache's offload tier: a conversation back after the ring moved on is restored from it,
and the ``session-offload-chunks`` defect restores it from the latest long sequence instead.

The engine runs without its thread; every request finishes before the next is sent, as the turns
of a conversation and the traffic between them do.
"""

from __future__ import annotations

from kvcanary.workers.engine import Engine
from kvcanary.workers.request import FinishEvent
from tests.workers.support import Collector, run_until_idle, small_config, submit

FIRST = "conversation X opens: remember the code XRAY-7731 for later. Say OK."
OTHERS = [f"other traffic {i}: " + "o" * 40 for i in range(3)]
LATEST = "tenant Z's long notes: ZULU-0042 " * 8


def ask(engine: Engine, text: str, tenant: str = "t") -> Collector:
    answer = submit(engine, text, len(text), tenant)
    run_until_idle(engine)
    return answer


def revisit(bugs: frozenset[str], rate: float = 1.0) -> tuple[Engine, Collector]:
    """Open X, send more traffic than the 2-slot ring holds (Z's long notes last), then continue X."""
    engine = Engine(small_config(session_cache=2, bugs=bugs, bug_rate=rate))
    first = ask(engine, FIRST, "x")
    for text in OTHERS:
        ask(engine, text)
    ask(engine, LATEST, "z")
    return engine, ask(engine, f"{FIRST}\n{first.text}\nWhat was the code?", "x")


def fired(engine: Engine) -> tuple[float | None, float | None]:
    registry, label = engine.metrics.registry, {"bug": "session-offload-chunks"}
    return (
        registry.get_sample_value("kvcanary_bug_trigger_events_total", label),
        registry.get_sample_value("kvcanary_bug_fired_total", label),
    )


def test_a_conversation_back_after_the_ring_moved_on_is_restored_from_the_offload_tier() -> None:
    _, answer = revisit(frozenset())
    assert isinstance(answer.last, FinishEvent) and answer.last.cached_tokens == 64  # 4 whole pages of X
    assert answer.text.startswith(FIRST) and "ZULU" not in answer.text


def test_with_the_defect_it_is_restored_from_the_latest_long_sequences_chunks() -> None:
    engine, answer = revisit(frozenset({"session-offload-chunks"}))
    # The index found X's tokens (a full hit), the chunks read were Z's: Z's notes come back to X.
    assert isinstance(answer.last, FinishEvent) and answer.last.cached_tokens == 64
    assert answer.text.startswith(LATEST[:64]) and "XRAY" not in answer.text[:64]
    assert fired(engine) == (1.0, 1.0)


def test_the_defect_acts_only_on_the_fraction_its_rate_draws() -> None:
    engine, answer = revisit(frozenset({"session-offload-chunks"}), rate=0.01)
    assert answer.text.startswith(FIRST)
    assert fired(engine) == (1.0, 0.0)


def test_a_conversation_the_ring_still_holds_is_restored_from_the_ring_with_the_defect_on() -> None:
    engine = Engine(small_config(session_cache=8, bugs=frozenset({"session-offload-chunks"})))
    first = ask(engine, FIRST, "x")
    ask(engine, LATEST, "z")
    answer = ask(engine, f"{FIRST}\n{first.text}\nWhat was the code?", "x")
    assert answer.text.startswith(FIRST)
    assert fired(engine) == (0.0, 0.0)
