"""The overlap check: a run of fingerprints (``OVERLAP_MIN_PROMPT_RUN`` in order, about 24 to 48
words) that one other caller alone holds and sent in a prompt is that caller's private input in
this answer, what a stale KV cache continues: a ``leak`` (suspected). The fingerprints, who holds
them and for how long are the window's (``monitor/traffic/overlap.py``); this file is the rule.

A run of anything another caller sent or was answered (``traffic.overlap_min_run``, e.g.
``OVERLAP_MIN_RUN``) is a rule an operator may turn on; it is off by default: a model reciting
public text (API docs, quotes, an article) gives several callers the same answer, and the second
one looks exactly like a leak of the first (bench/detection.py: 231 false flags in 5,000 benign
exchanges of 8 callers at a run of 8, against 1 for the prompt rule).

Callers who sent the same prompt are passed over (a deterministic answer to the same question is
the same text), and the exchange joins the window after it is judged.
"""

from __future__ import annotations

from kvcanary.monitor.traffic.checks.base import CheckContext, Finding, TrafficCheck
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.overlap import Overlap, OverlapWindow, Runs
from kvcanary.probes.base import Verdict

#: A run of anything another caller holds that an operator may count as a suspected leak (about 40
#: words in order; ``traffic.overlap_min_run``, off by default: the module doc).
OVERLAP_MIN_RUN = 8
#: The run of another caller's private input that makes a suspected leak; the settings'
#: ``traffic.overlap_min_prompt_run`` defaults to it. bench/detection.py, 5,000 benign exchanges of 8
#: callers: at 5, 1 false alarm and 93 % of 40-word private passages caught (95 % with the reworded
#: check beside it), 100 % of 80; at 4, 4 false alarms and 97 %.
OVERLAP_MIN_PROMPT_RUN = 5


def longest_unexcused_run(
    caller: str, prompt: list[int], response: list[int], window: Runs, now: float, min_run: int
) -> Overlap | None:
    """The longest run of ``response`` another caller holds, passing over callers who sent the
    same prompt (at most a few: each look is a scan of the response)."""
    if not response:
        return None
    excused: frozenset[str] = frozenset()
    found = window.longest_run(caller, prompt, response, now)
    while found.run >= min_run and len(excused) < 3 and window.holds_all(found.other_caller, prompt):
        excused |= {found.other_caller}
        found = window.longest_run(caller, prompt, response, now, excused)
    return found


def overlap_check(
    record: TrafficRecord,
    window: OverlapWindow,
    now: float,
    min_run: int | None = None,
    min_prompt_run: int = OVERLAP_MIN_PROMPT_RUN,
) -> Finding | None:
    """Judge the response against the window, then add the exchange to it."""
    prints = record.fingerprints
    if not prints.response and not prints.prompt:
        return None
    caller, prompt, response = record.caller, prints.prompt, prints.response
    # The run of anything first: a run of what one caller asked is never longer, so it is looked
    # for only where this one is long enough.
    bar = min_prompt_run if min_run is None else min(min_run, min_prompt_run)
    found = longest_unexcused_run(caller, prompt, response, window, now, bar)
    leaked = min_run is not None and found is not None and found.run >= min_run
    of = "anything"
    if found is not None and not leaked and found.run >= min_prompt_run:
        asked = longest_unexcused_run(caller, prompt, response, window.asked, now, min_prompt_run)
        if asked is not None and asked.run >= min_prompt_run:
            found, leaked, of = asked, True, "prompt"
    # A leaked answer's prints stay out of the window: served to a few more callers, the leaked
    # text would otherwise turn common and hide the rest.
    window.add(caller, prompt if leaked else [*prompt, *response], now, asked=len(prompt))
    if found is None:
        return None
    if not leaked:
        return OverlapCheck.passed
    figures = {
        "run": found.run,
        "response_fingerprints": found.fingerprints,
        "other_caller": found.other_caller,
        "of": of,  # the other caller's prompt (the shorter run), or anything it sent
    }
    return Finding(OverlapCheck.name, Verdict.LEAK, "another_callers_text", figures)


class OverlapCheck(TrafficCheck):
    name = "overlap"
    #: A text two customers both hold (a licence, a famous speech) overlaps too: a hint, not proof.
    certainty = "suspected"
    needs = frozenset({"window", "now", "min_run", "min_prompt_run"})

    def judge(self, record: TrafficRecord, context: CheckContext) -> Finding | None:
        return overlap_check(record, context.window, context.now, context.min_run, context.min_prompt_run)
