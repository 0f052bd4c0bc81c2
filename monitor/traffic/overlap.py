"""The fingerprint window of one deployment: which callers sent which fingerprints lately.

The rule (README, "How sure each check is"): a response is a suspected leak when a run of at least
``min_run`` consecutive fingerprints of it (in the response's order) all appear in what *one other
caller* sent or was sent within the window, where

- a fingerprint of the reader's own prompt breaks the run (a model quoting its caller): one the
  prompt's prints sent hold, or one the tap marked ``OWN`` (0: the whole prompt holds it);
- a fingerprint that ``common_callers`` or more distinct callers hold in the window is common
  (shared system prompts, licences, boilerplate) and breaks the run too;
- the reader's own earlier traffic never counts (a conversation quoting itself);
- a caller who holds every fingerprint of the reader's prompt (the tap sends the whole prompt's
  print first, so this is "sent the same prompt") is excused: the same question answered the same
  way for two callers is nobody's secret. An empty prompt excuses no one;
- a response found to carry another caller's text is not added to the window (only its prompt
  is): a leak served to several callers must not make the leaked text look common.

A fingerprint stands for 8 words and one in four n-grams is kept, so a run of 8 means a passage of
about 40 words copied in order. The window is bounded twice: by age (``window_seconds``) and by
the fingerprints it holds (``max_fingerprints``; the oldest exchanges go first). Nothing of it
touches the disk, and a fingerprint reveals nothing without the gateway's key.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

#: The tap's stand-in for a response fingerprint its own prompt holds (``kvcanary.tap.fingerprints.OWN``).
OWN = 0


@dataclass(frozen=True)
class Overlap:
    """The longest run a response shares with another caller."""

    run: int
    other_caller: str
    fingerprints: int  # the response's fingerprints, for the ratio


@dataclass(frozen=True)
class _Entry:
    seq: int
    caller: str
    at: float
    fingerprints: tuple[int, ...]


class OverlapWindow:
    """Fingerprints by caller within a window; see the module doc. Not thread-safe: one judge
    holds it, under the deployment's lock."""

    def __init__(
        self, window_seconds: float = 900.0, max_fingerprints: int = 250_000, common_callers: int = 3
    ):
        self.window_seconds = window_seconds
        self.max_fingerprints = max_fingerprints
        self.common_callers = common_callers
        self._entries: collections.deque[_Entry] = collections.deque()
        self._holders: dict[int, dict[str, int]] = {}  # fingerprint -> {caller: seq of its last entry}
        self._held = 0
        self._seq = 0

    @property
    def held(self) -> int:
        return self._held

    def longest_run(
        self,
        caller: str,
        prompt: list[int],
        response: list[int],
        now: float,
        excused: frozenset[str] = frozenset(),
    ) -> Overlap:
        """Return the longest run of ``response`` another caller (not one ``excused``) holds."""
        self._expire(now)
        own, skip = set(prompt), {caller, *excused}
        runs: dict[str, int] = {}
        best, best_caller = 0, ""
        for fingerprint in response:
            holders = self._holders.get(fingerprint)
            if fingerprint == OWN or fingerprint in own or not holders or len(holders) >= self.common_callers:
                runs = {}
                continue
            runs = {other: runs.get(other, 0) + 1 for other in holders if other not in skip}
            for other, run in runs.items():
                if run > best:
                    best, best_caller = run, other
        return Overlap(best, best_caller, len(response))

    def holds_all(self, caller: str, prints: list[int]) -> bool:
        """Whether ``caller`` holds every one of ``prints`` (OWN aside) in the window; False for none."""
        distinct = set(prints) - {OWN}
        return bool(distinct) and all(caller in self._holders.get(f, ()) for f in distinct)

    def add(self, caller: str, fingerprints: list[int], now: float) -> None:
        """Hold one exchange's fingerprints (its prompt's and its response's) for the window."""
        distinct = dict.fromkeys(fingerprints)
        distinct.pop(OWN, None)
        if not distinct:
            return
        unique = tuple(distinct)
        self._seq += 1
        seq, held = self._seq, self._holders
        self._entries.append(_Entry(seq, caller, now, unique))
        # The judge's hottest loop (every fingerprint of every record): no new dict for one held.
        for fingerprint in unique:
            holders = held.get(fingerprint)
            if holders is None:
                held[fingerprint] = {caller: seq}
            else:
                holders[caller] = seq
        self._held += len(unique)
        self._expire(now)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_seconds
        entries, held = self._entries, self._holders
        while entries and (entries[0].at < horizon or self._held > self.max_fingerprints):
            entry = entries.popleft()
            self._held -= len(entry.fingerprints)
            caller, seq = entry.caller, entry.seq
            for fingerprint in entry.fingerprints:
                holders = held.get(fingerprint)
                if holders is not None and holders.get(caller) == seq:
                    del holders[caller]
                    if not holders:
                        del held[fingerprint]
