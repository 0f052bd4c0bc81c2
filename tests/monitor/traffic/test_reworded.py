"""The reworded check (``monitor/traffic/checks/reworded.py``) and its window
(``monitor/traffic/distinctive.py``): another caller's names, figures and identifiers in new
sentences are a leak; the same tokens are nobody's secret when two callers hold them, when the
model says them unasked, when the reader holds them or asked about the same thing, or when they
come from several prompts. Records are the tap's own, made from text."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.checks.reworded import reworded_check
from kvcanary.monitor.traffic.distinctive import DistinctiveWindow
from kvcanary.monitor.traffic.judge import TrafficJudge
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize

FP = Fingerprinter(b"a-test-fingerprint-key-0123456789")
BASE = "http://127.0.0.1:9/v1"
NOTES = "Call Marta Oyelaran about invoice INV_7731: Hendrikson owes 48213 euros, due 2027."
LEAKED = "It seems Hendrikson still owes 48213, and someone should call Oyelaran about it."


def exchange(caller: str, prompt: str, response: str) -> TrafficRecord:
    made = Exchange("r", 1.8e9, caller, "team", BASE, prompt=prompt, response=response)
    return TrafficRecord.model_validate(summarize(made, FP))


def judged(window: DistinctiveWindow, *exchanges: tuple[str, str, str]) -> list[str]:
    """Each exchange's verdict in turn (``-``: not judged), one second apart."""
    verdicts = []
    for i, (caller, prompt, response) in enumerate(exchanges):
        found = reworded_check(exchange(caller, prompt, response), window, float(i), 3)
        verdicts.append("-" if found is None else found.verdict.value)
    return verdicts


def test_another_callers_tokens_in_new_sentences_are_a_leak_named_by_counts() -> None:
    window = DistinctiveWindow()
    assert judged(window, ("acme", NOTES, "Noted.")) == ["pass"]
    found = reworded_check(exchange("initech", "Weather today?", LEAKED), window, 1.0, 3)
    assert found is not None and found.verdict.value == "leak" and found.reason == "another_callers_tokens"
    assert found.figures == {"shared_tokens": 3, "response_tokens": 3, "other_caller": "acme"}
    assert "Hendrikson" not in repr(found) and "48213" not in repr(found)
    # Two tokens are not enough, and the check is off without a threshold.
    two = exchange("initech", "Weather today?", "Hendrikson owes 48213.")
    assert reworded_check(two, window, 2.0, 3).verdict.value == "pass"  # type: ignore[union-attr]
    assert reworded_check(exchange("globex", "Hi", LEAKED), window, 3.0, None) is None


def test_the_leaked_answer_stays_out_so_the_next_reader_is_caught_too() -> None:
    window = DistinctiveWindow()
    verdicts = judged(
        window, ("acme", NOTES, "Noted."), ("initech", "Weather?", LEAKED), ("globex", "Time?", LEAKED)
    )
    assert verdicts == ["pass", "leak", "leak"]  # not "said unasked": a leak is not the model's knowledge


def test_tokens_two_callers_hold_the_model_says_unasked_or_the_reader_holds_are_no_ones_secret() -> None:
    shared = DistinctiveWindow()
    assert (
        judged(shared, ("acme", NOTES, "Noted."), ("globex", NOTES, "Noted."), ("initech", "Hi", LEAKED))[-1]
        == "pass"
    )
    public = DistinctiveWindow()
    told = "Hendrikson is a firm; it owes 48213 and Oyelaran runs it."
    assert judged(public, ("acme", NOTES, "Noted."), ("globex", "Who?", told), ("initech", "Hi", LEAKED))[
        1:
    ] == [
        "leak",  # the first to be told: nothing showed it was known
        "leak",
    ]
    known = DistinctiveWindow()
    verdicts = judged(
        known, ("globex", "Who is Hendrikson?", told), ("acme", NOTES, "Noted."), ("initech", "Hi", LEAKED)
    )
    assert verdicts == ["pass", "pass", "pass"]  # said unasked before acme pasted it: public
    own = DistinctiveWindow()
    assert (
        judged(own, ("acme", NOTES, "Noted."), ("initech", NOTES, "Noted."), ("initech", "Hi", LEAKED))[-1]
        == "pass"
    )


def test_a_reader_who_asked_about_the_same_rare_thing_is_excused() -> None:
    window = DistinctiveWindow()
    verdicts = judged(window, ("acme", NOTES, "Noted."), ("initech", "What does Hendrikson owe?", LEAKED))
    assert verdicts == ["pass", "pass"]


def test_tokens_from_several_prompts_do_not_add_up() -> None:
    window = DistinctiveWindow()
    verdicts = judged(
        window,
        ("acme", "Hendrikson called.", "Noted."),
        ("acme", "The total is 48213.", "Noted."),
        ("acme", "Oyelaran is away.", "Noted."),
        ("initech", "Weather?", LEAKED),
    )
    assert verdicts[-1] == "pass"  # one caller's, but no one prompt holds three of them


def test_the_window_forgets_by_age_and_by_its_bound() -> None:
    aged = DistinctiveWindow(window_seconds=10)
    assert judged(aged, ("acme", NOTES, "Noted."))
    assert reworded_check(exchange("initech", "Hi", LEAKED), aged, 11.0, 3).verdict.value == "pass"  # type: ignore[union-attr]
    bounded = DistinctiveWindow(max_tokens=12)
    judged(
        bounded, ("acme", NOTES, "Noted."), ("globex", "Alpha Beta Gamma Delta Epsilon Zeta Eta", "Noted.")
    )
    assert bounded.held <= 12
    assert reworded_check(exchange("initech", "Hi", LEAKED), bounded, 2.0, 3).verdict.value == "pass"  # type: ignore[union-attr]


def test_the_judge_runs_it_and_its_results_are_stored_under_traffic_reworded() -> None:
    settings = Settings.model_validate(
        {"targets": [{"name": "t", "base_url": BASE, "tenants": [{"name": "a"}, {"name": "b"}]}]}
    )

    class Target:
        """The target's answers the judge asks for (a calibration, a pool): network calls."""

        calibration = TokenCalibration()
        calibration.note(1000, 250)

        async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
            return ServerCapacity(kv_pool_tokens=1_000_000)

    judge = TrafficJudge(settings, {"t": Target()}, MarkerBook(), MonitorMetrics(CollectorRegistry()))
    records = [exchange("acme", NOTES, "Noted."), exchange("initech", "Weather?", LEAKED)]
    done = asyncio.run(judge.judge(records, "gw"))
    (leak,) = [r for r in done.results if r.kind == "traffic_reworded" and r.result.verdict == "leak"]
    assert leak.source == "traffic" and leak.result.reason == "another_callers_tokens"
    off = settings.model_copy(
        update={"traffic": settings.traffic.model_copy(update={"reworded_min_tokens": None})}
    )
    judge.take_up(off)
    assert not [r for r in asyncio.run(judge.judge(records, "gw")).results if r.kind == "traffic_reworded"]


def test_the_excuse_holds_however_often_the_other_caller_sent_its_notes_again() -> None:
    window = DistinctiveWindow()
    asked_again = [("acme", NOTES, "Noted."), ("acme", NOTES + " Again?", "Noted.")]  # a chat resends history
    assert judged(window, *asked_again, ("initech", "What does Hendrikson owe?", LEAKED))[-1] == "pass"


def test_a_token_said_twice_counts_once() -> None:
    window = DistinctiveWindow()
    judged(window, ("acme", "Hendrikson and Oyelaran signed.", "Noted."))
    twice = reworded_check(
        exchange("initech", "Hi", "Hendrikson, Hendrikson, Hendrikson and Oyelaran."), window, 1.0, 3
    )
    assert twice is not None and twice.verdict.value == "pass"
    found = window.most_shared("globex", [], [7, 7, 7], 2.0, 3)  # a tap that does not dedupe
    assert found.tokens == 0


def test_an_answer_an_earlier_check_found_a_leak_is_not_made_public() -> None:
    window = DistinctiveWindow()
    judged(window, ("acme", NOTES, "Noted."))
    two = exchange("initech", "Hi", "Hendrikson owes 48213.")  # too few to flag here; the overlap check did
    assert reworded_check(two, window, 1.0, 3, leaked=True).verdict.value == "pass"  # type: ignore[union-attr]
    verdicts = judged(window, ("acme", NOTES, "Noted."), ("globex", "Time?", LEAKED))
    assert verdicts[-1] == "leak"  # not hidden as "said unasked" by the leak before
