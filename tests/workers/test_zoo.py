"""The bug zoo's event-delivery defects, driven without the engine thread.

What the process-level tests in ``tests/probes`` cannot pin down: an abort after a request ended is
no abort (counted nowhere, no defect acts on it), a request that never ran leaves nothing behind,
and an orphan's claimant whose own client leaves is handed on in its turn.
"""

from __future__ import annotations

from kvcanary.workers.engine import Engine
from kvcanary.workers.request import FinishEvent
from tests.workers.support import run_until_idle, small_config, submit


def aborted(engine: Engine) -> float | None:
    return engine.metrics.registry.get_sample_value("kvcanary_requests_aborted_total")


def test_an_abort_after_the_answer_ended_counts_nothing_and_feeds_no_defect() -> None:
    engine = Engine(small_config(bugs=frozenset({"abort-in-flight"})))
    submit(engine, "x" * 40, 40, "t")
    request = engine._waiting[0]
    run_until_idle(engine)
    assert request.finished and request.retired
    engine.abort(request)  # a handler's finally after the last chunk went out
    assert aborted(engine) == 0
    assert engine.zoo.orphans is not None and not engine.zoo.orphans._orphans
    assert (
        engine.metrics.registry.get_sample_value(
            "kvcanary_bug_trigger_events_total", {"bug": "abort-in-flight"}
        )
        == 0
    )


def test_a_request_aborted_before_it_ran_leaves_no_route_behind() -> None:
    engine = Engine(small_config(bugs=frozenset({"rid-collision"})))
    submit(engine, "x" * 40, 40, "a", client_id="same-id")
    first = engine._waiting[0]
    engine.abort(first)
    run_until_idle(engine)
    assert first.retired and engine.zoo.rid_routes is not None
    assert not engine.zoo.rid_routes._routes and not engine.zoo.rid_routes._spared


def test_a_claimant_whose_client_leaves_is_handed_on_with_the_rest() -> None:
    engine = Engine(small_config(max_batch=8, bugs=frozenset({"abort-in-flight"})))
    orphan = submit(engine, "A" * 60, 60, "a")
    engine.admit_waiting()
    engine.decode_once()
    engine.abort(engine.batch.requests[0])  # O: decodes on, its output waits for a claimant
    claimant = submit(engine, "C" * 60, 60, "c")
    engine.admit_waiting()  # C claims O's output
    c_request = engine.batch.requests[-1]
    engine.decode_once()
    engine.abort(c_request)  # C's client leaves too: C is an orphan in its turn
    heir = submit(engine, "D" * 30, 30, "d")
    run_until_idle(engine)
    assert len(orphan.events) == 1  # O's own client got its first token only
    assert claimant.text.startswith("A")  # C's client was answered with O's text
    assert "C" in heir.text and isinstance(heir.last, FinishEvent)  # D got the rest of C's answer
    orphans = engine.zoo.orphans
    assert orphans is not None
    assert not (orphans._orphans or orphans._held or orphans._claimant or orphans._serving or orphans._queued)
