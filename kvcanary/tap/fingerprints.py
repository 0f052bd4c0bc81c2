"""Keyed fingerprints of text: what lets the monitor see that two callers' texts overlap without
ever holding either text.

A text is cut into words (``words.py``: runs of word characters, lower-cased), every run of
``NGRAM`` consecutive words is hashed, and the hashes whose low bits are zero are kept (one in
``1 << SAMPLE_BITS``, in text order). Two texts that share a passage of ``L`` words share about
``(L - NGRAM + 1) / 4`` fingerprints, the same ones on both sides, since the choice depends on the
passage alone.

Each word's hash is a BLAKE2b MAC under the gateway's key, and an n-gram's hash is a polynomial of
its words' hashes. Without the key a fingerprint cannot be checked against a guessed text, so the
monitor (which never has the key) learns only which fingerprints repeat; the gateway's replicas
share one key so that their fingerprints meet.

Work is bounded: a text longer than ``MAX_TEXT_CHARS`` is fingerprinted from its head and tail
only (the incident's 681,280-token prompts must not stall a gateway), and at most
``MAX_FINGERPRINTS`` are kept a side. A response's fingerprint that its own prompt holds is sent
as ``OWN`` (0, never a fingerprint): the monitor sees where the model quoted its caller, however
long the prompt, without the prompt's every print. So is one of a text the gateway's operator
declared public (``public.py``: licences, published documentation, the company's own boilerplate),
which the prompt's list leaves out: a model reciting a licence that one customer pasted is no leak
of that customer's, and nothing else can tell the two apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from kvcanary.tap.words import lower, scalars, words
from kvcanary.wire import MAX_FINGERPRINTS as MAX_FINGERPRINTS

NGRAM = 8
SAMPLE_BITS = 2
#: Characters fingerprinted per text: the first and last half of this, when the text is longer.
MAX_TEXT_CHARS = 64 * 1024
#: Fingerprints are 51-bit integers (under 2**53: exact in any JSON reader), which leaves
#: collisions rare among the million or so a deployment's window holds.
FINGERPRINT_BITS = 51
#: Stands in the response's list for a fingerprint of the reader's own prompt (or a public text).
OWN = 0

_MOD = (1 << 64) - 1
_BASE = 0x100000001B3  # an odd multiplier: every word's place in the n-gram weighs differently
_TOP = pow(_BASE, NGRAM - 1, 1 << 64)
_SAMPLE_MASK = (1 << SAMPLE_BITS) - 1
_OUT_MASK = (1 << FINGERPRINT_BITS) - 1
#: Distinct words whose hash is remembered (natural text repeats a few thousand words).
_WORD_CACHE = 50_000


def cut(text: str) -> str:
    """Return what of ``text`` is fingerprinted: all of it, or its head and tail."""
    if len(text) <= MAX_TEXT_CHARS:
        return text
    half = MAX_TEXT_CHARS // 2
    return f"{text[:half]} {text[-half:]}"


def cut_joined(parts: Sequence[str], sep: str = "\n") -> str:
    """Return ``cut(sep.join(parts))``, joining no more of the parts than that: work in proportion
    to what is fingerprinted and to the number of parts, not to their length."""
    if joined_length(parts, sep) <= MAX_TEXT_CHARS:
        return sep.join(parts)
    half = MAX_TEXT_CHARS // 2
    head = _first_chars(_pieces(parts, sep), half)
    tail = _first_chars(_pieces(parts[::-1], sep), half, from_end=True)
    return f"{head} {tail}"


def joined_length(parts: Sequence[str], sep: str = "\n") -> int:
    """Return ``len(sep.join(parts))`` without joining them."""
    return sum(map(len, parts)) + len(sep) * max(len(parts) - 1, 0)


def _pieces(parts: Sequence[str], sep: str) -> Iterator[str]:
    for i, part in enumerate(parts):
        if i:
            yield sep
        yield part


def _first_chars(pieces: Iterator[str], count: int, *, from_end: bool = False) -> str:
    """Return the first ``count`` characters of the pieces joined, or with ``from_end`` (pieces
    given last first) the last ``count`` of them, in text order."""
    taken: list[str] = []
    for piece in pieces:
        if count <= 0:
            break
        taken.append(piece[-count:] if from_end else piece[:count])
        count -= len(taken[-1])
    return "".join(reversed(taken) if from_end else taken)


class Fingerprinter:
    """Fingerprints texts under one secret key (at least 16 bytes). Not thread-safe for writes to
    its word cache, which is harmless: a lost entry is computed again."""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("a fingerprint key needs at least 16 bytes")
        self._key = key[:64]  # BLAKE2b takes keys up to 64 bytes
        self._words: dict[str, int] = {}
        #: Prints of the texts declared public, and of their distinctive tokens
        #: (``kvcanary/tap/public.py``): no caller's own.
        self.public: frozenset[int] = frozenset()
        self.public_tokens: frozenset[int] = frozenset()

    @property
    def key(self) -> bytes:
        return self._key

    def fingerprints(self, text: str, cap: int | None = MAX_FINGERPRINTS) -> tuple[list[int], bool]:
        """Return the kept fingerprints of ``text`` in order (at most ``cap``; None: all), and
        whether only part of the text was read."""
        truncated = len(text) > MAX_TEXT_CHARS
        hashes = [self._word(word) for word in words(lower(scalars(cut(text))))]
        if len(hashes) < NGRAM:
            return [], truncated
        gram = 0
        for h in hashes[:NGRAM]:
            gram = (gram * _BASE + h) & _MOD
        kept: list[int] = []
        for i in range(NGRAM, len(hashes) + 1):
            mixed = (gram * 0x9E3779B97F4A7C15 & _MOD) >> 11  # spread the bits before sampling
            if mixed & _SAMPLE_MASK == 0:
                kept.append((mixed >> SAMPLE_BITS & _OUT_MASK) or 1)  # 0 is OWN
                if cap is not None and len(kept) >= cap:
                    return kept, True
            if i < len(hashes):
                gram = ((gram - hashes[i - NGRAM] * _TOP) * _BASE + hashes[i]) & _MOD
        return kept, truncated

    def whole(self, text: str) -> int:
        """Return one fingerprint of all of ``text`` (as fingerprinted: head and tail). Sent first
        among a prompt's prints, it lets the monitor see two callers sent the same prompt, however
        short (a prompt under ``NGRAM`` words has no other print)."""
        digest = hashlib.blake2b(
            scalars(cut(text)).encode("utf-8"), key=self._key, digest_size=8, person=b"kvc-whole"
        )
        return (int.from_bytes(digest.digest(), "big") & _OUT_MASK) or 1

    def _word(self, word: str) -> int:
        found = self._words.get(word)
        if found is None:
            digest = hashlib.blake2b(word.encode(), key=self._key, digest_size=8).digest()
            found = int.from_bytes(digest, "big")
            if len(self._words) >= _WORD_CACHE:
                self._words.clear()
            self._words[word] = found
        return found
