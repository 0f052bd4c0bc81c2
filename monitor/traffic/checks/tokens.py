"""The tokens check: ``prompt_tokens`` below ``chars / (chars_per_token * TOKENS_MARGIN)`` is
impossible for the prompt's size, a ``mismatch`` (the incident's engine reported 1 token for a
prompt of a million). ``chars_per_token`` is the most characters a token held in the monitor's own
probes of this target (``monitor/targets/calibration.py``), never a fixed guess.

The prompt's size as far as it is known (:func:`prompt_estimate`) is here too: the capacity check
and the judge's near-the-pool rows read it, and a blast radius over log files follows the same rule
(``monitor/blast/logs.py``).
"""

from __future__ import annotations

from kvcanary.monitor.traffic.checks.base import CheckContext, Finding, TrafficCheck
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.probes.base import Verdict
from kvcanary.wire import SURE_DENSITY_MARGIN

#: How far below the calibrated floor a count must fall to be impossible, not just dense text: the
#: wire's margin, which the gateway's admission guard also takes as sure.
TOKENS_MARGIN = SURE_DENSITY_MARGIN
#: Prompts shorter than this are not judged for tokens (a template's tokens dominate small ones).
TOKENS_MIN_CHARS = 1024


def prompt_floor(record: TrafficRecord, chars_per_token: float | None) -> float | None:
    """Return the fewest tokens the prompt can be, at the densest text the probes saw."""
    return None if not chars_per_token else record.prompt.chars / chars_per_token


def prompt_estimate(record: TrafficRecord, chars_per_token: float | None) -> float | None:
    """Return the prompt's size in tokens as far as it is known: the reported count where it is
    plausible (the engine counted; denser text than the probes' is no reason to doubt it), else
    the floor (the count is missing, or impossible as the tokens check says)."""
    floor = prompt_floor(record, chars_per_token)
    if floor is None:
        return None
    reported = record.usage.prompt_tokens
    plausible = reported is not None and reported * TOKENS_MARGIN >= floor
    return float(reported) if plausible and reported is not None else floor


class TokensCheck(TrafficCheck):
    name = "tokens"
    needs = frozenset({"chars_per_token"})

    def judge(self, record: TrafficRecord, context: CheckContext) -> Finding | None:
        """Flag an answered prompt whose reported count is impossible; None for a prompt too short
        to say, an unanswered one, or a target not yet calibrated."""
        chars_per_token, reported = context.chars_per_token, record.usage.prompt_tokens
        if not chars_per_token or reported is None or record.prompt.chars < TOKENS_MIN_CHARS or not record.ok:
            return None
        floor = record.prompt.chars / (chars_per_token * TOKENS_MARGIN)
        if reported >= floor:
            return self.passed
        figures = {"prompt_chars": record.prompt.chars, "prompt_tokens": reported, "floor": round(floor, 1)}
        return Finding(self.name, Verdict.MISMATCH, "prompt_tokens_impossible", figures)
