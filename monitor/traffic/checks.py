"""The four checks every traffic record gets: plain functions of a record and what the monitor
knows about its deployment. Each returns a :class:`Finding` (``pass``, ``leak`` or ``mismatch``
with its reason and figures) or None where it cannot judge (no calibration yet, no pool known).

The rules, and how sure each is, are in the README ("Judging real traffic"):

- **marker**: a live marker of this monitor in a customer's response is a probe's KV in a
  customer's answer: ``leak``. A forged or expired marker-shaped string is nobody's.
- **tokens**: ``prompt_tokens`` below ``chars / (chars_per_token * TOKENS_MARGIN)`` is impossible
  for the prompt's size. ``chars_per_token`` is the most characters a token held in the monitor's
  own probes of this target (``monitor/targets/calibration.py``), never a fixed guess.
- **capacity**: a 2xx for a prompt over the node's smallest KV pool (its own capacity reading,
  ``facts.py``). The size is the reported count where that is plausible, else the floor above
  (the densest text the probes saw): an over-pool prompt whose count was faked may pass, but one
  flagged on the floor is over.
- **overlap**: ``monitor/traffic/overlap.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from monitor.traffic.overlap import Overlap, OverlapWindow
from monitor.traffic.schema import TrafficRecord
from probes.markers import MarkerBook

CHECKS = ("marker", "tokens", "capacity", "overlap")
#: How far below the calibrated floor a count must fall to be impossible, not just dense text.
TOKENS_MARGIN = 8.0
#: Prompts shorter than this are not judged for tokens (a template's tokens dominate small ones).
TOKENS_MIN_CHARS = 1024
#: A prompt this close to its node's pool is kept as a row (what a blast radius needs later).
NEAR_POOL = 0.9
#: The fingerprint run that makes an overlap a suspected leak (about 40 words in order).
OVERLAP_MIN_RUN = 8


@dataclass(frozen=True)
class Finding:
    check: str
    verdict: str  # pass | leak | mismatch
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def flagged(self) -> bool:
        return self.verdict != "pass"


#: A pass of each check, made once: the judge's hottest path finds one per check per record, and a
#: frozen dataclass is safe to share.
PASSED = {check: Finding(check, "pass") for check in CHECKS}


def marker_check(
    record: TrafficRecord, book: MarkerBook, target: str
) -> tuple[Finding, list[dict[str, str]]]:
    """Return the finding and the evidence of each live marker (ids and hashes only)."""
    hits = book.scan(" ".join(record.markers), target=target, reader="") if record.markers else []
    if not hits:
        return PASSED["marker"], []
    evidence = [
        {"marker_id": h.marker_id, "marker_sha256": h.digest, "owner_target": h.owner_target,
         "owner_tenant": h.owner_tenant}
        for h in hits
    ]  # fmt: skip
    return Finding("marker", "leak", "probe_marker_in_customer_response", {"markers": len(hits)}), evidence


def prompt_floor(record: TrafficRecord, chars_per_token: float | None) -> float | None:
    """Return the fewest tokens the prompt can be, at the densest text the probes saw."""
    return None if not chars_per_token else record.prompt.chars / chars_per_token


def tokens_check(record: TrafficRecord, chars_per_token: float | None) -> Finding | None:
    reported = record.usage.prompt_tokens
    if not chars_per_token or reported is None or record.prompt.chars < TOKENS_MIN_CHARS or not record.ok:
        return None
    floor = record.prompt.chars / (chars_per_token * TOKENS_MARGIN)
    if reported >= floor:
        return PASSED["tokens"]
    figures = {"prompt_chars": record.prompt.chars, "prompt_tokens": reported, "floor": round(floor, 1)}
    return Finding("tokens", "mismatch", "prompt_tokens_impossible", figures)


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


def capacity_check(record: TrafficRecord, estimate: float | None, pool: int | None) -> Finding | None:
    if estimate is None or not pool or not record.ok:
        return None
    if estimate <= pool:
        return PASSED["capacity"]
    figures = {"estimated_prompt_tokens": round(estimate), "kv_pool_tokens": pool, "status": record.status}
    return Finding("capacity", "mismatch", "over_pool_answered", figures)


def longest_unexcused_run(
    caller: str, prompt: list[int], response: list[int], window: OverlapWindow, now: float, min_run: int
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
    record: TrafficRecord, window: OverlapWindow, now: float, min_run: int = OVERLAP_MIN_RUN
) -> Finding | None:
    """Judge the response against the window, then add the exchange to it."""
    prints = record.fingerprints
    if not prints.response and not prints.prompt:
        return None
    found = longest_unexcused_run(record.caller, prints.prompt, prints.response, window, now, min_run)
    leaked = found is not None and found.run >= min_run
    # A leaked answer's prints stay out of the window: served to a few more callers, the leaked
    # text would otherwise turn common and hide the rest.
    window.add(record.caller, prints.prompt if leaked else [*prints.prompt, *prints.response], now)
    if found is None:
        return None
    if not leaked:
        return PASSED["overlap"]
    figures = {
        "run": found.run,
        "response_fingerprints": found.fingerprints,
        "other_caller": found.other_caller,
    }
    return Finding("overlap", "leak", "another_callers_text", figures)
