"""Fresh random prompts for the ``prefix_cache`` probe, sized in the engine's own tokens.

Every prompt the audit sends is random lowercase letters separated by spaces, drawn from
:mod:`secrets` (Gu et al.'s prompts are 5,000 such letters, about one token each on BPE
tokenizers; byte tokenizers such as the reference worker's make two of each). Random for three
reasons:

- a cache hit on such a prefix can only come from a request that sent the very same text: with
  1,024 tokens of it there are far more than 2**1000 prefixes, so a hit is evidence of reuse, never
  of chance;
- it never carries a real tenant's data: the audit reads and sends nothing but its own noise;
- it never carries a marker (:mod:`probes.markers`): markers belong to the probes that look for
  foreign text in answers, and this one judges counters and clocks, not text.

A prompt is a shared prefix plus a short fresh tail, so no two requests are byte-identical: a hit
is prefix reuse, not an answer cache.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from string import ascii_lowercase
from typing import Any

from kvcanary.probes.base import ProbeContext, unjudgeable
from kvcanary.probes.target import Completion, CompletionRequest, ServerCapacity

#: Fresh letters after the shared prefix: enough to make each request unique, too few to matter.
TAIL_LETTERS = 4
#: A prefix spans at least this many KV pages, so a hit is whole pages of it, not a lucky first page.
MIN_PAGES = 4
#: Smallest prefix the audit sends whatever the page size: below it a hit would say little.
MIN_PREFIX_TOKENS = 64
#: Tokens kept free under the node's admission limit: the tail, a BOS, a chat template, one output.
HEADROOM_TOKENS = 64
#: Letters sent to the engine's tokenizer to learn how many tokens a letter costs (no completion).
SAMPLE_LETTERS = 512
# Byte -> letter: 256 % 26 leaves letters a-v one chance in 256 likelier than w-z, which costs a
# fraction of a bit of the ~4.7 bits per letter and nothing that matters here.
_LETTER_OF_BYTE = bytes(ord(ascii_lowercase[b % 26]) for b in range(256))


def fresh_text(letters: int) -> str:
    """Return ``letters`` random lowercase letters separated by single spaces (from ``secrets``)."""
    return " ".join(secrets.token_bytes(letters).translate(_LETTER_OF_BYTE).decode("ascii"))


def with_tail(prefix: str) -> str:
    """Return ``prefix`` followed by a fresh random tail: a unique request sharing the prefix."""
    return f"{prefix} {fresh_text(TAIL_LETTERS)}"


def salt() -> str:
    """Return a fresh cache salt: 256 random bits, 43 URL-safe characters (vLLM's suggestion)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class PromptSize:
    """How big the audit's prefixes are: ``letters`` each, ``tokens`` (counted by the engine when
    ``counted``, else estimated at one per letter) and what the node said (None: unknown)."""

    letters: int
    tokens: int
    counted: bool
    tokens_per_letter: float
    page_size: int | None
    admission_limit: int | None
    asked_tokens: int

    @property
    def request_tokens(self) -> int:
        """Return what one request costs: prefix, tail, a BOS and the one completion token."""
        return self.tokens + math.ceil(TAIL_LETTERS * self.tokens_per_letter) + 2

    @property
    def hit_tokens(self) -> int:
        """Return the fewest cached tokens that show a request reused the prefix: half of it, so
        that a template or a first page alone never passes for the prefix."""
        return max(1, self.tokens // 2)

    def evidence(self) -> dict[str, Any]:
        return {
            "prefix_letters": self.letters,
            "prefix_tokens": self.tokens,
            "prefix_tokens_counted": self.counted,
            "prefix_tokens_asked": self.asked_tokens,
            "page_size": self.page_size,
            "admission_limit": self.admission_limit,
        }


async def size_prefix(
    ctx: ProbeContext, asked: int, capacity: ServerCapacity | None = None
) -> PromptSize | str:
    """Return the prefix size for ``asked`` tokens on this target, or why none fits (a sentence).

    The prefix spans at least :data:`MIN_PAGES` pages of the node's ``page_size`` when known, and
    stays :data:`HEADROOM_TOKENS` under its admission limit (vLLM's ``max_model_len`` counts the
    output too). Tokens per letter come from the engine's tokenizer; without one (hosted APIs) a
    letter counts as one token, as on the BPE tokenizers Gu et al. audited.
    """
    if capacity is None:  # a caller that read it already passes it
        capacity = await ctx.target.capacity()
    page = capacity.page_size if capacity else None
    limit = capacity.admission_limit if capacity else None
    floor = max(MIN_PREFIX_TOKENS, MIN_PAGES * (page or 1))
    want = max(asked, floor)
    if limit is not None:
        want = min(want, limit - HEADROOM_TOKENS)
    if want < floor:
        return f"a {floor}-token prefix ({MIN_PAGES} pages) does not fit under the node's limit of {limit}"
    counted = await ctx.target.count_tokens(fresh_text(SAMPLE_LETTERS))
    rate = counted / SAMPLE_LETTERS if counted else 1.0
    letters = max(1, math.floor(want / rate))
    tokens = math.floor(letters * rate)
    return PromptSize(letters, tokens, bool(counted), rate, page, limit, asked)


def cache_request(
    prompt: str, *, chat: bool, stream: bool, cache_salt: str | None = None
) -> CompletionRequest:
    """Return a one-token request: the prefill is what the audit measures, not the output."""
    return CompletionRequest(
        prompt=prompt, max_tokens=1, chat=chat, stream=stream, temperature=0.0, cache_salt=cache_salt
    )


def failure(c: Completion) -> str | None:
    """Return why ``c`` cannot count as a measurement (a bounded reason), or None when it can."""
    why = unjudgeable(c)
    if why is None and not c.ok:
        return "refused"
    return why


def cached(c: Completion) -> int:
    """Return the cached tokens ``c`` reported, 0 when absent: call only once the engine is known to
    report them (vLLM omits the field when it is 0)."""
    return c.cached_tokens or 0


def row(role: str, tenant: str, c: Completion) -> dict[str, Any]:
    """Return one request as evidence: who sent it in which role, and what the engine said."""
    return {
        "role": role,
        "tenant": tenant,
        "status_code": c.status,
        "cached_tokens": c.cached_tokens,
        "prompt_tokens": c.prompt_tokens,
        "ttft_seconds": c.ttft_seconds,
        "error": failure(c),
    }
