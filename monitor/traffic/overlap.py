"""The fingerprint window of one deployment: which callers sent which fingerprints lately.

The rule (docs/operating.md, "Judging real traffic"): a response is a suspected leak when a run of at least
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
about 40 words copied in order.

**What another caller asked.** The window also knows which of a caller's prints it sent in a prompt
(``add``'s ``asked``). :meth:`OverlapWindow.longest_asked_run` counts only the prints that one other
caller alone holds and sent in the prompt of its latest exchange holding them: another caller's
private input, which is what a stale KV cache continues (another request's context). A public text
a model recites from memory (an API's documentation, a famous quote) reaches callers through their
answers, and a text two callers pasted (an article) is neither one's secret, so neither counts
there, and a shorter run of what is left is evidence. Measured by ``bench/detection.py``: 4 such
prints in a row catch 97 % of 40-word private passages, where 8 prints of anything catch 62 %, and
flag no benign answer that the run of 8 does not. :attr:`OverlapWindow.asked` offers that count
under the names ``longest_run`` and ``holds_all`` (:class:`Runs`), for the check's
``longest_unexcused_run``.

The window is bounded twice: by age (``window_seconds``) and by the fingerprints it holds
(``max_fingerprints``; the oldest exchanges go first). Nothing of it touches the disk, and a
fingerprint reveals nothing without the gateway's key.
"""

from __future__ import annotations

import collections
import math
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

#: The tap's stand-in for a response fingerprint its own prompt holds (``kvcanary.tap.fingerprints.OWN``).
OWN = 0


class Overlap(NamedTuple):
    """The longest run a response shares with another caller."""

    run: int
    other_caller: str
    fingerprints: int  # the response's fingerprints, for the ratio


class Runs(Protocol):
    """What finds runs: the window (runs of anything) or :attr:`OverlapWindow.asked` (runs of what
    one other caller asked), as the overlap check's ``longest_unexcused_run`` reads either."""

    def longest_run(
        self,
        caller: str,
        prompt: list[int],
        response: list[int],
        now: float,
        excused: frozenset[str] = frozenset(),
    ) -> Overlap: ...

    def holds_all(self, caller: str, prints: list[int]) -> bool: ...


class _Entry(NamedTuple):
    """One exchange held: its serial number, who sent it, when, its distinct fingerprints, and how
    many of them (the first) its prompt sent."""

    serial: int
    caller: str
    at: float
    fingerprints: tuple[int, ...]
    asked: int


class OverlapWindow:
    """Fingerprints by caller within a window; see the module doc. Not thread-safe: one judge
    holds it, under the deployment's lock.

    The judge's hottest path (every fingerprint of every record), so the window is kept in maps
    that whole-exchange operations change (``dict.update``, ``map``, set operations: a few hundred
    machine instructions a fingerprint) rather than a Python loop per fingerprint (thousands):

    - each caller's ``{fingerprint: the serial number of its latest entry holding it}``;
    - each fingerprint's holders, while fewer than ``common_callers``: the caller, for the one
      holder almost every fingerprint has, else ``{caller: None}`` in the order they came (which
      caller a tie names); a common fingerprint's holders are kept apart, so that a look-up finds
      it as a run breaker, like one nobody holds. They change only when a caller starts or stops
      holding a fingerprint, not when it sends one again;
    - for a run of asked prints only (never on the hot path), the prompt's prints of each entry
      looked at, as a set made when first needed and dropped with the entry;
    - the entries, oldest first, and by serial number how many fingerprints each is still its
      caller's latest of: an exchange whose every fingerprint its caller sent again since (a
      conversation's history, a document quoted again) expires without a look at any of them.

    The maps hold numbers and names, never objects, so that the cycle collector does not track
    them: a window of 250,000 fingerprints held by objects costs every full collection a walk
    over all of them (measured: more than twice the window's own work while it fills).
    Callers' names are interned, so that a name is found by identity wherever it is compared.
    """

    def __init__(
        self, window_seconds: float = 900.0, max_fingerprints: int = 250_000, common_callers: int = 3
    ):
        self.window_seconds = window_seconds
        self.max_fingerprints = max_fingerprints
        self.common_callers = common_callers
        self._entries: collections.deque[_Entry] = collections.deque()
        self._latest: dict[int, int] = {}  # entry serial -> how many prints it is the latest of
        self._serial = 0
        self._mine: dict[str, dict[int, int]] = {}  # caller -> {print: its latest entry's serial}
        self._prompts: dict[int, frozenset[int]] = {}  # entry serial -> its prompt's prints, when asked
        self._holders: dict[int, str | dict[str, None]] = {}  # held by fewer than common_callers
        self._common: dict[int, dict[str, None]] = {}  # held by common_callers or more
        self._held = 0

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
        found = list(map(self._holders.get, response))  # None: nobody's, or common
        skip = {sys.intern(caller), *excused}
        # Most answers: every print nobody's, common, or held by the reader (or one excused) alone.
        if found.count(None) + sum(map(found.count, skip)) == len(found):
            return Overlap(0, "", len(response))
        own: set[int] | None = None  # the prompt's prints, made only if another's print is met
        runs: dict[str, int] = {}  # each other caller's run ending at the print before
        best, best_caller = 0, ""
        for fingerprint, holders in zip(response, found, strict=True):
            if holders is None or (type(holders) is str and holders in skip):
                if runs:
                    runs = {}
                continue
            if own is None:
                own = set(prompt)  # OWN too, were it there: the window holds no OWN
            if fingerprint in own:
                runs = {}
            elif type(holders) is str:  # the one caller who holds it
                run = runs.get(holders, 0) + 1
                runs = {holders: run}
                if run > best:
                    best, best_caller = run, holders
            else:
                runs = {other: runs.get(other, 0) + 1 for other in holders if other not in skip}
                for other, run in runs.items():
                    if run > best:
                        best, best_caller = run, other
        return Overlap(best, best_caller, len(response))

    def longest_asked_run(
        self,
        caller: str,
        prompt: list[int],
        response: list[int],
        now: float,
        excused: frozenset[str] = frozenset(),
    ) -> Overlap:
        """Return the longest run of ``response`` that another caller (not one ``excused``) alone
        holds and sent in a prompt still in the window: :meth:`longest_run`'s rule, counting only
        what one caller asked. Not on the hot path: the check asks only when :meth:`longest_run`
        found a run, which is at least as long."""
        self._expire(now)
        skip = {sys.intern(caller), *excused}
        own = set(prompt)
        run, runner = 0, ""  # the run ending at the print before, and whose
        best, best_caller = 0, ""
        for fingerprint in response:
            holder = self._holders.get(fingerprint)
            # One holder only: a text two callers sent is no secret of either (an article both
            # pasted).
            if (
                type(holder) is not str
                or holder in skip
                or fingerprint in own
                or not self._asked_by(holder, fingerprint)
            ):
                run = 0
                continue
            run = run + 1 if holder == runner else 1
            runner = holder
            if run > best:
                best, best_caller = run, holder
        return Overlap(best, best_caller, len(response))

    def _asked_by(self, caller: str, fingerprint: int) -> bool:
        """Whether the latest exchange of ``caller`` holding ``fingerprint`` sent it in its prompt."""
        entries = self._entries
        entry = entries[self._mine[caller][fingerprint] - entries[0].serial]
        if entry.asked == len(entry.fingerprints) or not entry.asked:
            return bool(entry.asked)
        prompt = self._prompts.get(entry.serial)
        if prompt is None:
            prompt = self._prompts[entry.serial] = frozenset(entry.fingerprints[: entry.asked])
        return fingerprint in prompt

    @property
    def asked(self) -> AskedPrints:
        """The window counting only what callers asked (:meth:`longest_asked_run`)."""
        return AskedPrints(self)

    def holds_all(self, caller: str, prints: list[int]) -> bool:
        """Whether ``caller`` holds every one of ``prints`` (OWN aside) in the window; False for none."""
        distinct = set(prints) - {OWN}
        mine = self._mine.get(caller)
        return bool(distinct) and mine is not None and mine.keys() >= distinct

    def add(self, caller: str, fingerprints: list[int], now: float, asked: int | None = None) -> None:
        """Hold one exchange's fingerprints (its prompt's and its response's) for the window; the
        first ``asked`` of them are its prompt's (None: all of them)."""
        caller = sys.intern(caller)
        serial = self._serial
        count = len(fingerprints)
        cut = count if asked is None else min(max(asked, 0), count)
        fresh = dict.fromkeys(fingerprints if cut == count else fingerprints[:cut], serial)
        prompted = len(fresh) - (OWN in fresh)  # the prompt's distinct prints, first in ``fresh``
        if cut < count:
            fresh.update(dict.fromkeys(fingerprints[cut:], serial))
        fresh.pop(OWN, None)
        if not fresh:
            return
        self._serial += 1
        prints = tuple(fresh)
        self._entries.append(_Entry(serial, caller, now, prints, prompted))
        self._latest[serial] = len(prints)
        mine = self._mine.get(caller)
        if mine is None:
            mine = self._mine[caller] = {}
        before = list(map(mine.get, fresh))  # each print's latest entry of the caller, or None
        mine.update(fresh)
        # The entries this one takes prints from (most often one: the exchange sent again, or
        # none: new text), and None for the prints the caller starts holding.
        latest = self._latest
        for was in (before[0],) if before.count(before[0]) == len(before) else set(before):
            if was is None:
                everything = before.count(None) == len(before)
                self._join(caller, prints if everything else [
                    f for f, was in zip(prints, before, strict=True) if was is None
                ])  # fmt: skip
            else:
                latest[was] -= before.count(was)
        self._held += len(prints)
        self._expire(now)

    def _join(self, caller: str, started: Sequence[int]) -> None:
        """Make ``caller`` a holder of ``started``, prints it did not hold."""
        held, common, enough = self._holders, self._common, self.common_callers
        known = held.keys() & started
        if common:
            known |= common.keys() & started
        if enough > 1:
            held.update(dict.fromkeys([f for f in started if f not in known] if known else started, caller))
        else:  # one caller makes a print common
            common.update({f: {caller: None} for f in started if f not in known})
        for fingerprint in known:
            holders = held.get(fingerprint)
            if holders is None:
                common[fingerprint][caller] = None
                continue
            if isinstance(holders, str):
                holders = held[fingerprint] = {holders: None}
            holders[caller] = None
            if len(holders) >= enough:
                common[fingerprint] = holders
                del held[fingerprint]

    def expire(self, now: float, until: float = math.inf) -> bool:
        """Drop the exchanges past the window at ``now`` (by age, or the oldest over
        ``max_fingerprints``), stopping once the ``time.perf_counter()`` ``until`` passes (at least
        one dropped); return whether none is left to drop. A judge calls it in slices: a full
        window's worth at once (a deployment idle for the window) takes a third of a second."""
        horizon = now - self.window_seconds
        entries = self._entries
        while entries and (entries[0].at < horizon or self._held > self.max_fingerprints):
            entry = entries.popleft()
            self._held -= len(entry.fingerprints)
            if self._prompts:
                self._prompts.pop(entry.serial, None)
            if latest := self._latest.pop(entry.serial):
                self._stop_holding(entry, latest)
            if until != math.inf and time.perf_counter() >= until:
                return not entries or (entries[0].at >= horizon and self._held <= self.max_fingerprints)
        return True

    def _expire(self, now: float) -> None:
        self.expire(now)

    def _stop_holding(self, entry: _Entry, latest: int) -> None:
        """Drop the ``latest`` prints ``entry`` is its caller's latest of: no later exchange of it
        holds them."""
        caller, mine, serial = entry.caller, self._mine[entry.caller], entry.serial
        prints = entry.fingerprints
        ended = prints if latest == len(prints) else [f for f in prints if mine[f] == serial]
        if len(ended) == len(mine):
            del self._mine[caller]  # its last entry: nothing of the caller is held now
        else:
            for fingerprint in ended:
                del mine[fingerprint]
        held, common, enough = self._holders, self._common, self.common_callers
        for fingerprint in ended:
            holders = held.get(fingerprint)
            if holders is None:  # a common print
                holders = common[fingerprint]
                del holders[caller]
                if len(holders) < enough:
                    del common[fingerprint]
                    if holders:
                        held[fingerprint] = holders if len(holders) > 1 else next(iter(holders))
            elif isinstance(holders, str):
                del held[fingerprint]
            else:
                del holders[caller]
                if len(holders) == 1:
                    held[fingerprint] = next(iter(holders))


class AskedPrints:
    """A window's view that counts only what callers asked, under the names the overlap check's
    ``longest_unexcused_run`` calls: ``longest_run`` is :meth:`OverlapWindow.longest_asked_run`, and
    ``holds_all`` is the window's own (a caller who sent the same prompt asked it)."""

    def __init__(self, window: OverlapWindow):
        self.window = window

    def longest_run(
        self,
        caller: str,
        prompt: list[int],
        response: list[int],
        now: float,
        excused: frozenset[str] = frozenset(),
    ) -> Overlap:
        return self.window.longest_asked_run(caller, prompt, response, now, excused)

    def holds_all(self, caller: str, prints: list[int]) -> bool:
        return self.window.holds_all(caller, prints)
