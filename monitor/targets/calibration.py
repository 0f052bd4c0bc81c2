"""How many characters a token of this target holds, learnt from the monitor's own requests.

Probes size their prompts by the engine's own tokenizer (``count_tokens``: ``/tokenize``), a path
apart from the usage a completion reports, which is what the traffic checks doubt. The most
characters per token the tokenizer made of the probes' texts is the densest text it has been seen
to pack: the traffic checks (``monitor/traffic/checks/tokens.py``) take a prompt's
characters over it as a floor on its tokens. Nothing is assumed before the probes have spoken:
until a text of at least ``MIN_CHARS`` characters has been counted, there is no calibration and
the checks that need one do not judge. A probe that counts rarely (the canary keeps its count for
a while) leaves the judge to count ``SAMPLE_TEXT`` itself, once per ``RECOUNT_SECONDS``.
"""

from __future__ import annotations

MIN_SAMPLES = 1
MIN_CHARS = 64


#: Seconds between the judge's own counts of ``SAMPLE_TEXT`` while a target is uncalibrated.
RECOUNT_SECONDS = 600.0
#: The monitor's own calibration text: prose, numbers and hex, as a probe's prompts mix them.
SAMPLE_TEXT = (
    "Repeat the reference code exactly as written, then stop. The code is KVC-0a1b2c3d-"
    "00112233445566778899aabbccddeeff and it must come back unchanged, digit for digit. "
    "Shipping 14 parcels to 3 warehouses took 27 hours; the invoice lists 1,250 units at 4.75 each. "
) * 2


class TokenCalibration:
    """The densest characters-per-token ratio seen; ``None`` until ``MIN_SAMPLES`` samples."""

    def __init__(self) -> None:
        self.samples = 0
        self._densest = 0.0

    def note(self, chars: int, tokens: int | None) -> None:
        if tokens is None or tokens <= 0 or chars < MIN_CHARS:
            return
        self.samples += 1
        self._densest = max(self._densest, chars / tokens)

    @property
    def chars_per_token(self) -> float | None:
        return self._densest if self.samples >= MIN_SAMPLES else None
