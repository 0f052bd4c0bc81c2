"""The overlap rule on fingerprints made by the tap from real text (Debian's licences)."""

from __future__ import annotations

from pathlib import Path

from kvcanary.tap.fingerprints import OWN, Fingerprinter
from monitor.traffic.overlap import OverlapWindow

KEY = b"a-test-fingerprint-key-0123456789"
FP = Fingerprinter(KEY)
GPL = Path("/usr/share/common-licenses/GPL-3").read_text()
APACHE = Path("/usr/share/common-licenses/Apache-2.0").read_text()


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
