# ruff: noqa: RUF001 - letters that look like others, on purpose
"""The tap's distinctive tokens (``kvcanary/tap/distinctive.py``): which words are sent, keyed and
bounded, and a response's tokens its own prompt holds left out."""

from __future__ import annotations

from pathlib import Path

from kvcanary.tap.distinctive import MAX_TOKENS, TokenPrints, distinctive_words, is_distinctive
from kvcanary.tap.fingerprints import MAX_TEXT_CHARS, Fingerprinter
from kvcanary.tap.record import Exchange, summarize
from kvcanary.tap.words import lower, words

KEY = b"a-test-fingerprint-key-0123456789"


def test_names_figures_and_identifiers_are_distinctive_and_plain_words_are_not() -> None:
    text = (
        "Our client Hendrikson Ltd owes 48213 euros on invoice INV_7731 since 2026; "
        "the 12 items ship by DHL from x86 racks, see pg_dump. café Zürich 東京タワー ok No."
    )
    assert distinctive_words(text) == [
        "our", "hendrikson", "ltd", "48213", "inv_7731", "2026", "dhl", "x86", "pg_dump", "zürich",
    ]  # fmt: skip
    # A sentence's first word counts (the monitor learns "Our" is common); short words never do.
    assert not is_distinctive("12") and not is_distinctive("123") and is_distinctive("1234")
    assert not is_distinctive("No") and not is_distinctive("plain") and is_distinctive("a_b")


def test_prints_are_keyed_and_case_blind() -> None:
    one, other = TokenPrints(KEY), TokenPrints(b"another-key-of-enough-bytes-0001")
    assert one.of("Hendrikson") == one.of("HENDRIKSON owes")[:1] == [one.print_of("hendrikson")]
    assert one.of("Hendrikson") != other.of("Hendrikson")
    assert all(0 < p < 2**53 for p in one.of("Alpha Beta 2026 x_y"))


def test_an_answer_sends_only_the_tokens_its_own_prompt_does_not_hold() -> None:
    tap = TokenPrints(KEY)
    asked, said = tap.exchange(
        "Tell me about Lisbon and the Tagus.", "Lisbon sits on the Tagus, founded 1147."
    )
    assert said == tap.of("founded 1147")[-1:]  # "Lisbon" and "Tagus" are the caller's own
    assert tap.print_of("lisbon") in asked


def test_a_long_text_sends_at_most_max_tokens_a_side_from_what_the_fingerprints_read() -> None:
    text = " ".join(f"Name{i}" for i in range(20_000))  # far past MAX_TEXT_CHARS
    assert len(text) > MAX_TEXT_CHARS
    asked, said = TokenPrints(KEY).exchange(text, text[::-1])
    assert len(asked) == MAX_TOKENS and len(said) == MAX_TOKENS
    record = summarize(
        Exchange("r", 1.0, "c", "team", "http://x", prompt=text, response="Hi Zed."), Fingerprinter(KEY)
    )
    assert record["distinctive"]["prompt"] == asked
    assert record["distinctive"]["response"] == [TokenPrints(KEY).print_of("zed")]


def test_the_inlined_rule_is_the_documented_one_on_real_text() -> None:
    text = (
        Path("/usr/share/common-licenses/GPL-3").read_text()
        + " x²y ß ǅemal Ωmega 東京タワー 3½ 0123 ٣٤٥٦ a_b DİYARBAKIR ΟΔΟΣ नमस्ते Straße ＡＢＣ"
    )
    made = distinctive_words(text)
    assert made == list(dict.fromkeys(lower(w) for w in words(text) if is_distinctive(w)))
    assert len(made) > 50 and {"diyarbakir", "οδοσ", "ａｂｃ"} <= set(made)
    assert "٣٤٥٦" not in made and "नमस्ते" not in made  # other scripts' digits; no case
