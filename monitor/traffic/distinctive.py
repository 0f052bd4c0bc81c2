"""The distinctive-token window of one deployment: whose prompts held which names, figures and
identifiers lately, and which of them the model says unasked.

The rule (``checks/reworded.py``, docs/detection.md): an answer carries another caller's private
facts when at least ``min_shared`` of its distinctive tokens (``kvcanary/tap/distinctive.py``)
come from the prompts of **one** other caller, and from **few** of them (at most half as many
prompts as tokens, plus one), where a token counts only if

- the reader's own prompt does not hold it (the tap leaves those out) and the reader never sent
  it in the window (its own conversation; what the reader was told unasked is public, below);
- exactly one caller's prompts hold it in the window: a name two callers sent is neither one's
  secret;
- no answer said it unasked in the window: what a model says to a caller who did not mention it
  is what the model knows (a city's rivers, a library's functions), public however rare;

and the reader did not ask about the same thing: a prompt that shares a **rare** token (in other
callers' prompts of at most ``RARE_SHARE`` of the window's exchanges) with one of those prompts is
excused (a caller asking "tell me about Lisbon" after another pasted notes on Lisbon, however
often that one sent its notes again). A token in many prompts (a shared system prompt's, a
team's) excuses nothing.

Few prompts is what separates a leak from coincidence: a stale KV cache continues one request's
context (some of whose tokens the caller may have sent again since: each token is placed in the
caller's latest prompt holding it), while a long benign answer meets one token of each of many
prompts. bench/detection.py: counting tokens per caller with no bound on its prompts, 1 benign flag
(a code answer) in 5,000; with the bound, none.

Bounded like the fingerprint window (``overlap.py``): by age and by the tokens held (oldest
exchanges go first). Tokens are keyed prints; nothing of the text reaches the monitor.
"""

from __future__ import annotations

import collections
import math
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

#: The share of the window's exchanges whose prompts (other callers' than the one whose tokens an
#: answer holds) a token may be in and still show two callers asked about the same thing.
#: bench/detection.py, 5,000 benign exchanges of 8 callers: at 1 %, no benign flag and 91 % of
#: 5-token reworded leaks caught; a larger share excuses more leaks (a reader's prompt shares
#: some uncommon token with the victim's more often); with no excuse, 4 benign flags (a caller
#: asking about a city another pasted notes on).
RARE_SHARE = 0.01


class Shared(NamedTuple):
    """The most private tokens an answer shares with one exchange of another caller."""

    tokens: int
    other_caller: str
    response_tokens: int  # the answer's distinctive tokens not in its own prompt


class _Entry(NamedTuple):
    serial: int
    caller: str
    at: float
    asked: tuple[int, ...]  # distinct
    said: tuple[int, ...]  # distinct, none of them asked


class DistinctiveWindow:
    """Distinctive tokens by caller within a window; see the module doc. Not thread-safe: one
    judge holds it, under the deployment's lock.

    On the judge's hot path (every token of every record), so, as the fingerprint window
    (``overlap.py``), it is kept in maps that whole-exchange operations change (``dict.update``,
    ``map``, set operations) rather than a Python loop per token:

    - each caller's ``{token: the serial of its latest prompt holding it}``;
    - each token's holders, the callers whose prompts hold it: its one caller (most tokens), else
      ``{caller: None}``; they change only when a caller starts or stops holding a token, not when
      it sends one again. An answer's tokens need no holders: what an answer said unasked is
      public, and what it repeated of its prompt its caller holds;
    - the latest answer that said each token unasked;
    - the entries, oldest first, and by serial how many tokens each is still its caller's latest
      prompt of, so that an exchange whose every token its caller sent again since (a system
      prompt, a conversation's history) expires without a look at any of them.

    Two callers' tokens "from one prompt" are counted by the latest prompt of the other caller
    that holds each: a prompt sent again moves all its tokens together.
    """

    def __init__(self, window_seconds: float = 900.0, max_tokens: int = 250_000):
        self.window_seconds = window_seconds
        self.max_tokens = max_tokens
        self._entries: collections.deque[_Entry] = collections.deque()
        self._serial = 0
        self._prompted: dict[str, dict[int, int]] = {}  # caller -> {token: its latest prompt's serial}
        self._latest: dict[int, int] = {}  # serial -> tokens it is its caller's latest prompt of
        self._holders: dict[int, str | dict[str, None]] = {}  # token -> its caller, or callers
        self._said: dict[int, int] = {}  # token -> the latest answer's serial that said it unasked
        self._held = 0

    @property
    def held(self) -> int:
        return self._held

    def most_shared(
        self, caller: str, prompt: Sequence[int], response: Sequence[int], now: float, min_shared: int
    ) -> Shared:
        """Return the other caller whose prompts give ``response`` the most private tokens, among
        those that reach ``min_shared`` from few prompts and are not excused (tokens 0: none)."""
        self._expire(now)
        response = list(dict.fromkeys(response))  # a token said twice is one (a tap need not dedupe)
        holders = list(map(self._holders.get, response))
        if holders.count(None) == len(holders):  # most answers: every token nobody's prompt's
            return Shared(0, "", len(response))
        asked: frozenset[int] | None = None  # made only if another caller's token is met
        counts: dict[str, int] = {}
        prompts: dict[str, set[int]] = {}
        for token, holder in zip(response, holders, strict=True):
            # One holder only (a token two callers hold is neither's secret), and not the reader.
            if not isinstance(holder, str) or holder == caller or token in self._said:
                continue
            if asked is None:
                asked = frozenset(prompt)
            serial = self._prompted.get(holder, {}).get(token)
            if serial is not None and token not in asked:
                counts[holder] = counts.get(holder, 0) + 1
                prompts.setdefault(holder, set()).add(serial)
        for other, shared in sorted(counts.items(), key=lambda item: -item[1]):
            if shared < min_shared:
                break
            if len(prompts[other]) > shared // 2 + 1:
                continue  # one token of each of many prompts: a coincidence
            first = self._entries[0].serial
            topics = (
                self._same_topic(self._entries[s - first], asked or frozenset()) for s in prompts[other]
            )
            if not any(topics):
                return Shared(shared, other, len(response))
        return Shared(0, "", len(response))

    def _same_topic(self, entry: _Entry, asked: frozenset[int]) -> bool:
        """Whether the reader's prompt shares a rare token with ``entry``'s prompt: one that the
        prompts of other callers than ``entry``'s hold in at most ``RARE_SHARE`` of the window's
        exchanges (a caller resending its own history never makes its topic common). Counted by
        a walk of the window, which only a suspected leak costs, and cut short past the bound."""
        rare = max(1.0, len(self._entries) * RARE_SHARE)
        for token in asked.intersection(entry.asked):
            prompts = 0
            for held in self._entries:
                if held.caller is not entry.caller and token in held.asked:
                    prompts += 1
                    if prompts > rare:
                        break
            else:
                return True
        return False

    def add(self, caller: str, prompt: Sequence[int], response: Sequence[int], now: float) -> None:
        """Hold one exchange: its prompt's tokens, and the tokens its answer said unasked (pass
        none for an answer found to carry another caller's: a leak must not make them public)."""
        fresh = dict.fromkeys(prompt, self._serial)
        asked = tuple(fresh)
        said = tuple(t for t in dict.fromkeys(response) if t not in fresh)
        if not asked and not said:
            return
        serial, caller = self._serial, sys.intern(caller)
        self._serial += 1
        self._entries.append(_Entry(serial, caller, now, asked, said))
        if asked:
            self._latest[serial] = len(asked)
            self._take(caller, fresh)
        if said:
            self._said.update(dict.fromkeys(said, serial))
        self._held += len(asked) + len(said)
        self._expire(now)

    def _take(self, caller: str, fresh: dict[int, int]) -> None:
        """Make ``fresh``'s serial the latest prompt of its tokens for ``caller``, counting down the
        entries they move from; the caller starts holding the tokens it did not hold."""
        prompted = self._prompted.setdefault(caller, {})
        before = list(map(prompted.get, fresh))
        prompted.update(fresh)
        first = before[0]
        if before.count(first) == len(before):  # most prompts: all new, or all sent again at once
            if first is None:
                self._join(caller, list(fresh))
            else:
                self._latest[first] -= len(before)
            return
        moved = collections.Counter(before)  # counted in C: the entries the tokens move from
        started = moved.pop(None, 0)
        for was, count in moved.items():
            self._latest[was] -= count  # type: ignore[index]  # None was popped
        if started:
            self._join(caller, list(fresh) if started == len(before) else [
                t for t, w in zip(fresh, before, strict=True) if w is None
            ])  # fmt: skip

    def _join(self, caller: str, started: list[int]) -> None:
        holders = self._holders
        known = holders.keys() & started
        holders.update(dict.fromkeys([t for t in started if t not in known] if known else started, caller))
        for token in known:
            held = holders[token]
            if isinstance(held, str):
                holders[token] = {held: None, caller: None}
            else:
                held[caller] = None

    def expire(self, now: float, until: float = math.inf) -> bool:
        """Drop the exchanges past the window at ``now`` (by age, or the oldest over ``max_tokens``),
        stopping once the ``time.perf_counter()`` ``until`` passes (at least one dropped); return
        whether none is left to drop. A judge calls it in slices: a window's worth at once is long."""
        horizon = now - self.window_seconds
        entries = self._entries
        while entries and (entries[0].at < horizon or self._held > self.max_tokens):
            self._drop(entries.popleft())
            if until != math.inf and time.perf_counter() >= until:
                return not entries or (entries[0].at >= horizon and self._held <= self.max_tokens)
        return True

    def _expire(self, now: float) -> None:
        self.expire(now)

    def _drop(self, entry: _Entry) -> None:
        serial, caller = entry.serial, entry.caller
        self._held -= len(entry.asked) + len(entry.said)
        if self._latest.pop(serial, 0):
            prompted = self._prompted[caller]
            ended = [t for t in entry.asked if prompted[t] == serial]
            for token in ended:
                del prompted[token]
            if not prompted:
                del self._prompted[caller]
            self._leave(caller, ended)
        for token in entry.said:
            if self._said.get(token) == serial:
                del self._said[token]

    def _leave(self, caller: str, ended: list[int]) -> None:
        holders = self._holders
        for token in ended:
            held = holders[token]
            if isinstance(held, str):
                del holders[token]
                continue
            del held[caller]
            if len(held) == 1:
                holders[token] = next(iter(held))
