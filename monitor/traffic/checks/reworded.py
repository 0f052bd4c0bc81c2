"""The reworded check: an answer that says ``REWORDED_MIN_TOKENS`` or more of one other caller's
private names, figures and identifiers, from few of its prompts, is a ``leak`` (suspected),
however new its sentences: what a stale KV cache does when the model continues another request's
context. The tokens, who holds them and which are public are the window's
(``monitor/traffic/distinctive.py``); this file is the rule.

It sees what the overlap check cannot (no 8-word run need survive) and is blind where that one
sees (a copied passage of lower-case prose holds few such tokens): the two are run side by side.
Measured by ``bench/detection.py`` on the benign corpus and on answers that put k of another
caller's tokens into new sentences (docs/detection.md).

Never the tokens themselves: the finding names how many, of how many, and whose.
"""

from __future__ import annotations

from kvcanary.monitor.traffic.checks.base import CheckContext, Finding, TrafficCheck
from kvcanary.monitor.traffic.distinctive import DistinctiveWindow
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.probes.base import Verdict

#: Private tokens of one other caller's prompt that make a suspected leak (the settings'
#: ``traffic.reworded_min_tokens`` defaults to it; bench/detection.py: no benign flag at 3).
REWORDED_MIN_TOKENS = 3


def reworded_check(
    record: TrafficRecord, window: DistinctiveWindow, now: float, min_tokens: int | None, leaked: bool = False
) -> Finding | None:
    """Judge the answer's tokens against the window, then add the exchange to it; ``leaked``: an
    earlier check found the answer a leak (its tokens stay out of the window too)."""
    tokens = record.distinctive
    if min_tokens is None or not (tokens.prompt or tokens.response):
        return None
    if not tokens.response:  # nothing to judge: the prompt joins the window
        window.add(record.caller, tokens.prompt, (), now)
        return None
    found = window.most_shared(record.caller, tokens.prompt, tokens.response, now, min_tokens)
    flagged = found.tokens >= min_tokens
    # A leaked answer's tokens stay out: said to the reader, they would look public.
    window.add(record.caller, tokens.prompt, () if flagged or leaked else tokens.response, now)
    if not flagged:
        return RewordedCheck.passed
    figures = {
        "shared_tokens": found.tokens,
        "response_tokens": found.response_tokens,
        "other_caller": found.other_caller,
    }
    return Finding(RewordedCheck.name, Verdict.LEAK, "another_callers_tokens", figures)


class RewordedCheck(TrafficCheck):
    name = "reworded"
    #: A text two customers both hold (a licence, a famous speech) overlaps too: a hint, not proof.
    certainty = "suspected"
    needs = frozenset({"distinctive", "now", "reworded_min_tokens", "leaked"})

    def judge(self, record: TrafficRecord, context: CheckContext) -> Finding | None:
        window, now, least = context.distinctive, context.now, context.reworded_min_tokens
        return reworded_check(record, window, now, least, leaked=context.leaked)
