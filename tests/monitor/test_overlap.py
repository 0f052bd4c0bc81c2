"""The overlap rule on fingerprints made by the tap from real text (Debian's licences)."""

from __future__ import annotations

from pathlib import Path

from kvcanary.tap.fingerprints import OWN, Fingerprinter
from kvcanary.tap.record import Exchange, summarize
from monitor.traffic.checks import overlap_check
from monitor.traffic.overlap import OverlapWindow
from monitor.traffic.schema import TrafficRecord

KEY = b"a-test-fingerprint-key-0123456789"
FP = Fingerprinter(KEY)
GPL = Path("/usr/share/common-licenses/GPL-3").read_text()
APACHE = Path("/usr/share/common-licenses/Apache-2.0").read_text()
MPL = Path("/usr/share/common-licenses/MPL-2.0").read_text()


def prints(text: str) -> list[int]:
    return FP.fingerprints(text)[0]


def test_another_callers_text_in_an_answer_is_a_long_run_and_its_own_is_none() -> None:
    window = OverlapWindow()
    window.add("acme", prints(GPL[:6000]), now=0.0)
    leaked = prints("Sure, here: " + GPL[2000:3500])
    found = window.longest_run("globex", [], leaked, now=1.0)
    assert found.other_caller == "acme" and found.run >= 0.8 * len(leaked) > 20
    assert window.longest_run("acme", [], leaked, now=1.0).run == 0  # acme reading its own text
    assert window.longest_run("globex", prints(GPL[:6000]), leaked, now=1.0).run == 0  # in its prompt
    assert window.longest_run("globex", [], [OWN] * len(leaked), now=1.0).run == 0


def test_text_three_callers_hold_is_common_and_never_a_leak() -> None:
    window = OverlapWindow(common_callers=3)
    for caller in ("acme", "globex"):
        window.add(caller, prints(APACHE[:5000]), now=0.0)
    quote = prints(APACHE[1000:3000])
    assert window.longest_run("initech", [], quote, now=1.0).run > 20  # two holders: still someone's
    window.add("hooli", prints(APACHE[:5000]), now=0.0)
    assert window.longest_run("initech", [], quote, now=1.0).run == 0  # three: boilerplate


def test_the_window_forgets_by_age_and_by_size() -> None:
    window = OverlapWindow(window_seconds=60, max_fingerprints=1000)
    window.add("acme", prints(GPL[:5000]), now=0.0)
    quote = prints(GPL[1000:3000])
    assert window.longest_run("globex", [], quote, now=59.0).run > 0
    assert window.longest_run("globex", [], quote, now=61.0).run == 0 and window.held == 0
    for i in range(40):
        window.add(f"c{i}", prints(GPL[i * 800 : i * 800 + 4000]), now=100.0)
    assert window.held <= 1000


def judge(window: OverlapWindow, caller: str, prompt: str, response: str, now: float) -> str:
    """The overlap check's verdict on one exchange as the tap summarizes it."""
    rec = TrafficRecord.model_validate(
        summarize(Exchange(f"{caller}-{now}", 1.8e9, caller, "team", "http://x/v1", prompt=prompt,
                           response=response), FP)
    )  # fmt: skip
    found = overlap_check(rec, window, now)
    return found.verdict if found is not None else "none"


def test_the_same_question_answered_the_same_for_two_callers_is_not_a_leak() -> None:
    window = OverlapWindow()
    answer = MPL[:2500]  # a deterministic answer: a licence text written out
    assert judge(window, "acme", "Print the licence of this package.", answer, 1.0) == "pass"
    assert judge(window, "globex", "Print the licence of this package.", answer, 2.0) == "pass"
    # Asked something else, and answered with acme's answer: that is acme's text.
    assert judge(window, "initech", "What is the capital of Peru?", answer, 3.0) == "leak"


def test_a_leak_served_to_many_callers_is_caught_in_every_answer() -> None:
    window = OverlapWindow(common_callers=3)
    assert judge(window, "acme", GPL[:6000], "Noted.", 1.0) == "none"  # no answer to judge
    verdicts = [
        judge(window, caller, f"Summarize my notes, number {i}.", "Sure: " + GPL[1000:3000], 2.0 + i)
        for i, caller in enumerate(("b", "c", "d", "e", "f"))
    ]
    assert verdicts == ["leak"] * 5  # the leaked text never turns common by being leaked
