"""Public texts (``kvcanary/tap/public.py``): read whole, told to the tap from its environment, and
left out of what a record says is anyone's (a bad path stops the gateway, naming the variable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcanary.tap import Tap, TapConfigError
from kvcanary.tap.fingerprints import MAX_TEXT_CHARS, OWN, Fingerprinter
from kvcanary.tap.public import MAX_PUBLIC_BYTES, files_of, public_prints
from kvcanary.tap.record import Exchange, summarize

KEY = b"a-test-fingerprint-key-0123456789"
LICENCE = Path("/usr/share/common-licenses/GPL-3").read_text()


def test_a_long_text_is_read_whole_not_head_and_tail() -> None:
    text = (LICENCE * 4)[: 3 * MAX_TEXT_CHARS]
    middle = text[MAX_TEXT_CHARS : MAX_TEXT_CHARS + 4000]  # what head and tail alone would miss
    known = public_prints([text], Fingerprinter(KEY))
    in_middle, _ = Fingerprinter(KEY).fingerprints(middle)
    assert len(in_middle) > 50 and set(in_middle[1:-1]) <= known.prints
    assert known.files == 1 and len(known.tokens) > 20


def test_the_public_texts_a_gateway_names_are_read_at_start_and_a_bad_path_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCANARY_TAP_URL", "http://127.0.0.1:9")  # never reached: nothing is sent
    monkeypatch.setenv("KVCANARY_TAP_TOKEN", "ingest-token")
    monkeypatch.setenv("KVCANARY_TAP_KEY", KEY.decode())
    (tmp_path / "house").mkdir()
    (tmp_path / "house" / "boilerplate.txt").write_text(LICENCE[:5000])
    texts = f"{tmp_path / 'house'}:/usr/share/common-licenses/Apache-2.0"
    monkeypatch.setenv("KVCANARY_TAP_PUBLIC_TEXTS", texts)
    tap = Tap.from_env()
    try:
        told = tap.sender.fingerprinter
        assert len(told.public) > 150 and told.public_tokens
        recited = Exchange("r", 1.8e9, "b", "team", "http://x/v1", response=LICENCE[1000:4000])
        recital = summarize(recited, told)
        said = recital["fingerprints"]["response"]  # type: ignore[index]
        assert said.count(OWN) > 100 and len(said) - said.count(OWN) <= 2  # the cut first word's
        assert len(recital["distinctive"]["response"]) <= 1  # type: ignore[index]  # its tokens: public
    finally:
        tap.close(0.1)
    monkeypatch.setenv("KVCANARY_TAP_PUBLIC_TEXTS", str(tmp_path / "missing"))
    with pytest.raises(TapConfigError, match=r"KVCANARY_TAP_PUBLIC_TEXTS: .*missing"):
        Tap.from_env()


def test_more_public_text_than_a_gateway_should_hold_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (MAX_PUBLIC_BYTES + 1))
    with pytest.raises(ValueError, match="bytes of text"):
        files_of([tmp_path])
