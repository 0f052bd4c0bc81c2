"""Engine text made safe: one line, bounded, nothing hidden, names made of name characters only."""

from __future__ import annotations

import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from kvcanary.probes.untrusted import ELLIPSIS, plain, word


def test_control_characters_become_spaces_and_format_characters_show() -> None:
    assert plain("a\x1b[31mred\x07\x00\nnext\u2028line", 100) == "a [31mred next line"
    assert plain("\u202eevil\u202c \u200bzero\ufeff", 100) == "\ufffdevil\ufffd \ufffdzero\ufffd"


def test_a_name_keeps_name_characters_and_loses_markup() -> None:
    assert word("prefill") == "prefill"
    assert word("0.5.9.post1+cu128 (abc)") == "0.5.9.post1+cu128 (abc)"
    assert word("<script>alert(1)</script>") == "?script?alert(1)?/script?"
    assert word('"><img src=x onerror=alert(1)>') == "???img src=x onerror=alert(1)?"
    assert word("*bold* `code` |link|") == "?bold? ?code? ?link?"


def test_length_is_bounded_with_an_ellipsis_and_bounded_work() -> None:
    assert plain("x" * 10, 10) == "x" * 10
    assert plain("x" * 11, 10) == "x" * 9 + ELLIPSIS
    assert len(plain("y" * 50_000_000, 300)) == 300


@given(st.text())
def test_nothing_hidden_survives_any_text(text: str) -> None:
    for out in (plain(text, 80), word(text, 80)):
        assert len(out) <= 80
        assert not any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp") for c in out)
        assert "\n" not in out and "<" not in word(text, 80)
