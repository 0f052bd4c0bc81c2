"""The distinctive-token window of one deployment: whose prompts held which names, figures and
identifiers lately, and which of them the model says unasked.

The rule (``checks/reworded.py``, docs/detection.md): an answer carries another caller's private
facts when at least ``min_shared`` of its distinctive tokens (``kvcanary/tap/distinctive.py``)
come from the prompt of **one** exchange of **one** other caller, where a token counts only if

- the reader's own prompt does not hold it (the tap leaves those out) and the reader never sent
  or was sent it in the window (its own conversation);
- exactly one caller holds it in the window: a name two callers sent is neither one's secret;
- no answer said it unasked in the window: what a model says to a caller who did not mention it
  is what the model knows (a city's rivers, a library's functions), public however rare;

and the reader did not ask about the same thing: a prompt that shares a **rare** token (in at most
``RARE_SHARE`` of the window's prompts) with that exchange's prompt is excused (a caller
asking "tell me about Lisbon" after another pasted notes on Lisbon). A token in many prompts
(a shared system prompt's, a team's) excuses nothing.

Counting within one exchange's prompt is what separates a leak from coincidence: a stale KV cache
continues one request's context, while a long benign answer meets a few tokens of many prompts.

Bounded like the fingerprint window (``overlap.py``): by age and by the tokens held (oldest
exchanges go first). Tokens are keyed prints; nothing of the text reaches the monitor.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Sequence
from typing import NamedTuple

#: The share of the window's prompts a token may be in and still show two callers asked about
#: the same thing. bench/traffic.py, 5,000 benign exchanges of 8 callers: at 1 %, no benign flag
#: and 94 % of 5-token reworded leaks caught; at 5 %, 78 % (a reader's prompt shares some
#: uncommon token with the victim's more often); with no excuse, 4 benign flags (a caller asking
#: about a city another pasted notes on).
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
    asked: frozenset[int]
    said: tuple[int, ...]


class DistinctiveWindow:
    """Distinctive tokens by caller and by prompt within a window; see the module doc. Not
    thread-safe: one judge holds it, under the deployment's lock."""

    def __init__(self, window_seconds: float = 900.0, max_tokens: int = 250_000):
        self.window_seconds = window_seconds
        self.max_tokens = max_tokens
        self._entries: collections.deque[_Entry] = collections.deque()
        self._serial = 0
        self._holders: dict[int, dict[str, int]] = {}  # token -> {caller: entries of it holding it}
        self._said: dict[int, int] = {}  # token -> answers that said it unasked
        self._asked_in: dict[int, dict[int, None]] = {}  # token -> serials of the prompts holding it
        self._held = 0

    @property
    def held(self) -> int:
        return self._held

    def most_shared(
        self, caller: str, prompt: Sequence[int], response: Sequence[int], now: float, min_shared: int
    ) -> Shared:
        """Return the exchange of another caller whose prompt gives ``response`` the most private
        tokens, among those that reach ``min_shared`` and are not excused (tokens 0: none)."""
        self._expire(now)
        asked = frozenset(prompt)
        counts: collections.Counter[int] = collections.Counter()
        for token in response:
            holders = self._holders.get(token)
            if holders is None or len(holders) != 1 or caller in holders or token in asked:
                continue
            if token not in self._said:
                counts.update(self._asked_in.get(token, {}).keys())
        for serial, shared in counts.most_common():
            if shared < min_shared:
                break
            entry = self._entries[serial - self._entries[0].serial]
            if not self._same_topic(entry, asked):
                return Shared(shared, entry.caller, len(response))
        return Shared(0, "", len(response))

    def _same_topic(self, entry: _Entry, asked: frozenset[int]) -> bool:
        """Whether the reader's prompt shares a rare token with ``entry``'s prompt."""
        rare = max(1.0, len(self._entries) * RARE_SHARE)
        return any(len(self._asked_in[t]) <= rare for t in entry.asked & asked)

    def add(self, caller: str, prompt: Sequence[int], response: Sequence[int], now: float) -> None:
        """Hold one exchange: its prompt's tokens, and the tokens its answer said unasked (pass
        none for an answer found to carry another caller's: a leak must not make them public)."""
        asked = frozenset(prompt)
        said = tuple(t for t in dict.fromkeys(response) if t not in asked)
        if not asked and not said:
            return
        caller = sys.intern(caller)
        serial = self._serial
        self._serial += 1
        self._entries.append(_Entry(serial, caller, now, asked, said))
        for token in asked.union(said):
            mine = self._holders.setdefault(token, {})
            mine[caller] = mine.get(caller, 0) + 1
        for token in said:
            self._said[token] = self._said.get(token, 0) + 1
        for token in asked:
            self._asked_in.setdefault(token, {})[serial] = None
        self._held += len(asked) + len(said)
        self._expire(now)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_seconds
        entries = self._entries
        while entries and (entries[0].at < horizon or self._held > self.max_tokens):
            self._drop(entries.popleft())

    def _drop(self, entry: _Entry) -> None:
        self._held -= len(entry.asked) + len(entry.said)
        for token in entry.asked.union(entry.said):
            mine = self._holders[token]
            if mine[entry.caller] > 1:
                mine[entry.caller] -= 1
            elif len(mine) > 1:
                del mine[entry.caller]
            else:
                del self._holders[token]
        for token in entry.said:
            if self._said[token] > 1:
                self._said[token] -= 1
            else:
                del self._said[token]
        for token in entry.asked:
            prompts = self._asked_in[token]
            del prompts[entry.serial]
            if not prompts:
                del self._asked_in[token]
