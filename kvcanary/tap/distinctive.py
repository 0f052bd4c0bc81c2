"""The distinctive tokens of a text, keyed: what lets the monitor see another caller's names,
numbers and identifiers in an answer that says them in new words.

A stale KV cache rarely copies a passage of another customer's prompt: the model continues that
context, and its answer reuses the context's names, figures and identifiers in sentences of its
own, which no n-gram print (``fingerprints.py``) meets. So the tap also sends one keyed print of
each distinct token of the text that has the shape of such a fact (:func:`distinctive_words`):

- a word of ASCII digits alone, of at least ``MIN_DIGITS`` (an order number, a year, an amount;
  not a list's "12");
- any other word of at least ``MIN_CHARS`` code points that holds an ASCII digit or an underscore
  (``x86``, ``pg_dump``, ``INV_7731``) or that lower-casing changes (a capital: a name, a product,
  an acronym; a sentence's first word too: the monitor learns that "The" is common, the tap need
  not know English).

Words are cut and lower-cased as the fingerprints cut them (``words.py``). Digits of other scripts
are word characters like letters, and make no word distinctive: the rule needs no Unicode table.
Which tokens are common (held by many callers, said by the model unasked) is the monitor's to
learn from the traffic (``monitor/traffic/distinctive.py``), not the tap's.

Each print is a BLAKE2b MAC of the lower-cased word under the gateway's key (person ``kvc-token``),
so the monitor, which never has the key, cannot test a guess. A prompt sends its first
``MAX_TOKENS`` distinct tokens (of what the fingerprints read: head and tail of a long text); an
answer sends its first ``MAX_TOKENS`` that its own prompt does not hold: a model repeating its
caller's names is no one else's.
"""

from __future__ import annotations

import hashlib
import re

from kvcanary.tap.fingerprints import FINGERPRINT_BITS, cut
from kvcanary.tap.words import lower, scalars, words
from kvcanary.wire import MAX_TOKENS as MAX_TOKENS

#: Characters of a token with a digit, a capital or an underscore.
MIN_CHARS = 3
#: Digits of a token of digits alone.
MIN_DIGITS = 4

_DIGITS_RE = re.compile("[0-9]+")
_DIGIT_OR_UNDERSCORE_RE = re.compile("[0-9_]")
_MASK = (1 << FINGERPRINT_BITS) - 1


def distinctive_words(text: str) -> list[str]:
    """Return the distinct distinctive tokens of ``text`` (as fingerprinted: head and tail of a
    long one), lower-cased, in the order they first appear."""
    found: dict[str, None] = {}
    read = scalars(cut(text))
    # Lower-casing maps each code point to one and keeps every word a word: the text's words and
    # its lower-cased text's pair up, and the text is lower-cased once, in C, not a word at a time.
    # is_distinctive's rule, inlined: a call a word doubled the tap's work on a long text.
    for word, lowered in zip(words(read), words(lower(read)), strict=True):
        if len(word) < MIN_CHARS or (word.isascii() and word.isalpha() and word.islower()):
            continue  # most words: short, or lower-case ASCII letters only
        if _DIGITS_RE.fullmatch(word):
            if len(word) >= MIN_DIGITS:
                found[word] = None
            continue
        if lowered != word or _DIGIT_OR_UNDERSCORE_RE.search(word):
            found[lowered] = None
    return list(found)


def is_distinctive(word: str) -> bool:
    """Whether a word (a run of word characters, ``words.py``) has the shape of a name, a figure or
    an identifier: at least ``MIN_CHARS`` code points, and all ASCII digits with at least
    ``MIN_DIGITS`` of them, or (not all ASCII digits) an ASCII digit or an underscore in it, or a
    code point that lower-casing changes (a capital)."""
    if len(word) < MIN_CHARS:
        return False
    if _DIGITS_RE.fullmatch(word):
        return len(word) >= MIN_DIGITS
    return lower(word) != word or _DIGIT_OR_UNDERSCORE_RE.search(word) is not None


class TokenPrints:
    """Keyed prints of distinctive tokens under one secret key (the fingerprints' key)."""

    def __init__(self, key: bytes):
        self._key = key[:64]

    def of(self, text: str) -> list[int]:
        """Return the prints of every distinctive token of ``text``, in order (no cap)."""
        return [self.print_of(word) for word in distinctive_words(text)]

    def print_of(self, word: str) -> int:
        """Return one lower-cased token's print (0 is never one)."""
        digest = hashlib.blake2b(scalars(word).encode("utf-8"), key=self._key, digest_size=8,
                                 person=b"kvc-token")  # fmt: skip
        return (int.from_bytes(digest.digest(), "big") & _MASK) or 1

    def exchange(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        """Return what a record sends: the prompt's first ``MAX_TOKENS`` prints, and the first
        ``MAX_TOKENS`` of the response's that the whole prompt does not hold."""
        asked = self.of(prompt)
        own = set(asked)
        said = [p for p in self.of(response) if p not in own]
        return asked[:MAX_TOKENS], said[:MAX_TOKENS]
