"""The overlap rule on fingerprints made by the tap from real text (Debian's licences)."""

from __future__ import annotations

from pathlib import Path

from kvcanary.monitor.traffic.checks import overlap_check
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.overlap import OverlapWindow
from kvcanary.tap.fingerprints import OWN, Fingerprinter
from kvcanary.tap.record import Exchange, summarize

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


def judge(
    window: OverlapWindow, caller: str, prompt: str, response: str, now: float, min_run: int | None = None
) -> str:
    """The overlap check's verdict on one exchange as the tap summarizes it (``min_run``: the run of
    anything another caller holds that flags too; off by default, as in the settings)."""
    rec = TrafficRecord.model_validate(
        summarize(Exchange(f"{caller}-{now}", 1.8e9, caller, "team", "http://x/v1", prompt=prompt,
                           response=response), FP)
    )  # fmt: skip
    found = overlap_check(rec, window, now, min_run)
    return found.verdict if found is not None else "none"


def test_the_same_question_answered_the_same_for_two_callers_is_not_a_leak() -> None:
    window = OverlapWindow()
    answer = MPL[:2500]  # a deterministic answer: a licence text written out
    assert judge(window, "acme", "Print the licence of this package.", answer, 1.0) == "pass"
    assert judge(window, "globex", "Print the licence of this package.", answer, 2.0) == "pass"
    # Asked something else, and answered with acme's answer: by default not a leak (a model
    # reciting public text answers so too: only another caller's prompt counts), and a leak where
    # the run of anything is turned on.
    assert judge(window, "initech", "What is the capital of Peru?", answer, 3.0) == "pass"
    opted_in = OverlapWindow()
    assert judge(opted_in, "acme", "Print the licence of this package.", answer, 1.0, min_run=8) == "pass"
    assert judge(opted_in, "globex", "Print the licence of this package.", answer, 2.0, min_run=8) == "pass"
    assert judge(opted_in, "initech", "What is the capital of Peru?", answer, 3.0, min_run=8) == "leak"


def test_a_leak_served_to_many_callers_is_caught_in_every_answer() -> None:
    window = OverlapWindow(common_callers=3)
    assert judge(window, "acme", GPL[:6000], "Noted.", 1.0) == "none"  # no answer to judge
    verdicts = [
        judge(window, caller, f"Summarize my notes, number {i}.", "Sure: " + GPL[1000:3000], 2.0 + i)
        for i, caller in enumerate(("b", "c", "d", "e", "f"))
    ]
    assert verdicts == ["leak"] * 5  # the leaked text never turns common by being leaked


# What a caller asked: the window's shorter run of another caller's prompt (``longest_asked_run``).

#: Eight callers' own texts (each licence read by one caller only, as its private data) and the
#: public texts they share.
OWN_TEXTS = {
    f"c{i}": Path(f"/usr/share/common-licenses/{name}").read_text()
    for i, name in enumerate(
        ("Apache-2.0", "Artistic", "GFDL-1.3", "GPL-2", "MPL-1.1", "MPL-2.0", "LGPL-2.1", "CC0-1.0")
    )
}
SYSTEM = "You are the assistant of a software company. Answer in English, briefly, and cite the text you use."
#: Public articles, each pasted by two callers (c0 and c1, c2 and c3, ...).
ARTICLES = [
    GPL[20000:],
    *(Path(f"/usr/share/common-licenses/{name}").read_text() for name in ("BSD", "LGPL-3", "GPL-1")),
]
QUOTE = (
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed by "
    "their Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit "
    "of Happiness."
)


def exchange(caller: str, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """The prompt's and the response's prints as the tap sends them."""
    sent = summarize(
        Exchange("r", 1.8e9, caller, "team", "http://x/v1", prompt=prompt, response=response), FP
    )
    return sent["fingerprints"]["prompt"], sent["fingerprints"]["response"]


def words(text: str, start: int, count: int) -> str:
    return " ".join(text.split()[start : start + count])


def test_a_40_word_passage_of_another_callers_prompt_is_a_run_of_what_it_asked() -> None:
    window = OverlapWindow()
    window.add("acme", prints(GPL), now=0.0)
    found = []
    for start in range(100, 3100, 100):  # 30 passages of 40 words of acme's prompt
        leaked = prints("Sure. " + words(GPL, start, 40))
        asked = window.asked.longest_run("globex", [], leaked, now=1.0)
        assert asked.run <= window.longest_run("globex", [], leaked, now=1.0).run  # never longer
        found.append(asked.run >= 4 and asked.other_caller == "acme")
    assert sum(found) >= 27  # the bench measures 97 % (a run of 8 prints of anything: 62 %)


def test_what_a_caller_was_answered_is_not_what_it_asked() -> None:
    window = OverlapWindow()
    prompt, answer = exchange("acme", "Print the licence of this package.", MPL[:4000])
    window.add("acme", [*prompt, *answer], now=0.0, asked=len(prompt))
    leaked = prints("Sure. " + MPL[1000:1400])
    assert window.longest_run("globex", [], leaked, now=1.0).run >= 4  # acme's text all the same
    assert window.asked.longest_run("globex", [], leaked, now=1.0).run == 0
    window.add("acme", prints(MPL[:4000]), now=100.0)  # acme pastes it: now it asked it
    assert window.asked.longest_run("globex", [], leaked, now=101.0).run >= 4
    assert window.asked.longest_run("globex", [], leaked, now=1001.0).run == 0  # and it is gone


def test_text_two_callers_asked_is_neither_ones_secret() -> None:
    window = OverlapWindow()
    for caller in ("acme", "globex"):  # both pasted the same public article
        window.add(caller, prints(APACHE[:6000]), now=0.0)
    retold = prints("It says: " + words(APACHE, 300, 60))
    assert window.longest_run("initech", [], retold, now=1.0).run >= 8  # judged by the run of 8
    assert window.asked.longest_run("initech", [], retold, now=1.0).run == 0


def test_eight_callers_sharing_boilerplate_and_public_text_ask_no_run_and_a_private_passage_does() -> None:
    """Eight callers send a system prompt and the GPL, their own text (a licence no other caller
    reads), and a pasted article (shared by two callers); their answers quote their prompts, the
    GPL, the article and a famous quote. No answer holds a run of 4 prints another caller alone
    asked; 40 words of a caller's own text in another's answer do."""
    window = OverlapWindow()
    callers = sorted(OWN_TEXTS)
    now = 0.0
    for turn in range(6):
        for i, caller in enumerate(callers):
            now += 1.0
            own, article = OWN_TEXTS[caller], ARTICLES[i // 2]
            at = 500 + 700 * turn
            prompt_text = "\n".join([SYSTEM, GPL[:3000], own[at : at + 2500], article[:3000]])
            answer = [own[at + 100 : at + 900], GPL[500:1200], article[900:1600], QUOTE][(turn + i) % 4]
            prompt, response = exchange(caller, prompt_text, f"Here it is: {answer} Anything else?")
            found = window.asked.longest_run(caller, prompt, response, now)
            assert found.run < 4, (turn, caller, found)
            window.add(caller, [*prompt, *response], now, asked=len(prompt))
    leaks = [
        window.asked.longest_run("c5", [], prints("Sure. " + words(OWN_TEXTS["c0"][500:], start, 40)), now)
        for start in range(0, 800, 40)  # 20 passages side by side
    ]
    assert sum(found.run >= 4 and found.other_caller == "c0" for found in leaks) >= 17  # 13 with 8 prints
