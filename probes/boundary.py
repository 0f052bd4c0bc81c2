"""Boundary: does the node refuse a prompt its KV cache cannot hold, before generating?

Targets the incident itself: a context window (1,048,576) larger than the prefill KV pool
(681,280), and an engine that answered an over-capacity request with HTTP 200, decoded over stale
pages of other tenants, and reported ``prompt_tokens = 1``. The single-node path refused the same
request with HTTP 400. This probe reads what the node says it can hold (the smallest of context
window, KV pool and maximum request length), sends a raw prompt just over it, and expects a 4xx.

Why the check is sound:

- The prompt's length is measured by the engine's own tokenizer (``/tokenize``) and adjusted until
  it is at least ``limit + 1`` tokens, aiming at no more than :func:`over_margin` over: a 200
  cannot be blamed on a prompt that secretly fitted. Without a tokenizer the probe calibrates
  tokens per character from the usage of two small requests and adds a safety margin (the larger
  of the margin and 0.5% of the limit), so it errs on the side of "over".
- The answer is judged, not just its status: a 200 is a ``mismatch`` (``accepted_over_capacity``)
  whatever it says, with the prompt tokens the engine reported beside those sent, and its text is
  scanned for other tenants' live markers like every response (:func:`~probes.base.judge`): stale
  pages holding them make it a ``leak``. So that this does not hang on chance, the probe first
  primes the node as another tenant (the disclosure's reproduction: plant as one customer,
  overflow as another): an under-limit prompt of that tenant's markers, whose pages LIFO reuse
  hands to the over-capacity request first. The big prompt repeats one of the probing tenant's
  own markers, so a stale read of it elsewhere is attributable too.
- A refusal counts only if the same path accepts a small prompt (a control request, sent after the
  big one so that its pages are not the first a stale read meets); a path that refuses everything
  says nothing about capacity. No answer, a 5xx or an auth failure is an ``error``, never a pass.

Options: ``tenant`` (default: the target's first; the next one primes), ``prime`` (default true),
``max_prompt_tokens`` (default 2,000,000: what it will send at most), ``max_tokens`` (256: what a
wrongly admitted request may generate). It runs every 300 seconds by default.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict, excerpt, unjudgeable
from kvcanary.probes.markers import redact_markers
from kvcanary.probes.target import Completion, CompletionRequest, ServerCapacity

#: Tokens over the limit the prompt may end at: as tight as a BPE tokenizer allows, within a page.
OVERSHOOT_TOKENS = 8
#: Small beside the prompt, yet long enough for a stale read to hold a whole 45-character marker
#: (the filler repeats one every 113 characters).
MAX_TOKENS = 256
#: Tokens the priming prompt stays under the admission limit (tokenizer slack).
PRIME_HEADROOM = 64
#: Largest priming prompt: it fills the first pages a stale read meets, cheaply on any node.
PRIME_MAX_TOKENS = 8192
DEFAULT_MAX_PROMPT_TOKENS = 2_000_000
MAX_SIZING_ROUNDS = 8
#: Size of control and calibration prompts: small, but a fair sample of the filler.
CONTROL_CHARS = 1024
#: Extra share of the limit added when tokens are estimated from usage instead of counted.
USAGE_SAFETY_SHARE = 0.005
_UNIT = "{marker} boundary filler line: the quick brown fox jumps over the lazy dog.\n"


def over_margin(page_size: int | None) -> int:
    """Return how many tokens over the limit a prompt may end: at most 8, and within one page.

    Aiming at ``limit + 1`` tests an off-by-one admission check; staying within a page keeps the
    request one page beyond what the pool can hold when the limit is page-aligned.
    """
    return max(1, min(OVERSHOOT_TOKENS, page_size or OVERSHOOT_TOKENS))


def filler(marker: str, chars: int) -> str:
    """Return exactly ``chars`` characters of filler that repeats ``marker`` (built fast, by repetition)."""
    unit = _UNIT.format(marker=marker)
    return (unit * (chars // len(unit) + 1))[:chars]


@dataclass
class Sized:
    """A prompt and its size in tokens: ``counted`` by the engine's tokenizer, or estimated."""

    text: str
    tokens: int
    counted: bool


class BoundaryOptions(ProbeOptions):
    tenant: str | None = None  # probe as this tenant (default: the first)
    prime: bool = True  # plant another tenant's markers first, so a stale read is attributable
    max_tokens: int = Field(MAX_TOKENS, ge=1, le=8192)
    max_prompt_tokens: int = Field(DEFAULT_MAX_PROMPT_TOKENS, ge=1)
    # What the operator knows of the node when it states nothing itself (or states it wrong).
    context_window: int | None = Field(None, ge=1)
    kv_pool_tokens: int | None = Field(None, ge=1)
    max_req_input_len: int | None = Field(None, ge=1)
    page_size: int | None = Field(None, ge=1)


class BoundaryProbe(Probe):
    """Send a prompt just over the node's KV capacity; pass only on a refusal before generating."""

    kind = "boundary"
    verifies_suspicion = True
    reaudit_on_config_change = True
    judges_pool = True
    runs_alone = True
    default_interval_seconds = 300.0
    options_model = BoundaryOptions

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        if not ctx.tenants:
            return ProbeResult.error("no_tenants", "the target names no tenant to probe as")
        tenant = str(ctx.options.get("tenant") or ctx.tenants[0])
        capacity = await ctx.target.capacity()
        limit = capacity.admission_limit if capacity else None
        if capacity is None or not limit:
            detail = "the node states neither its context window nor its KV pool"
            return ProbeResult.error("capacity_unknown", detail)
        ceiling = int(ctx.options.get("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS))
        if limit + 1 > ceiling:
            return _too_large(limit + 1, ceiling, limit)
        _, marker = ctx.markers.plant(ctx.target.name, tenant)
        sizer = _Sizer(ctx, tenant, marker, limit, over_margin(capacity.page_size))
        sized = await sizer.size()
        if isinstance(sized, ProbeResult):
            return sized
        if sized.tokens > ceiling:
            return _too_large(sized.tokens, ceiling, limit)
        max_tokens = int(ctx.options.get("max_tokens", MAX_TOKENS))
        primed = None
        if ctx.options.get("prime", True):
            primed = await _prime(ctx, tenant, sized, capacity, max_tokens)
        request = CompletionRequest(sized.text, max_tokens=max_tokens, chat=False, stream=False)
        result = _verdict(await ctx.complete(tenant, request), sized, capacity, limit)
        result.evidence["prime"] = primed
        if result.verdict is Verdict.PASS and sized.counted:
            # No small request of ours went first (it would sit at the head of the free list).
            control = await sizer.control(sizer.sample_chars)
            if not control.answered:
                detail = "the small control prompt was refused too: the refusal says nothing about capacity"
                return dataclasses.replace(
                    result, verdict=Verdict.ERROR, reason="control_failed", detail=detail
                )
        return result


async def _prime(
    ctx: ProbeContext, tenant: str, sized: Sized, capacity: ServerCapacity, max_tokens: int
) -> dict[str, Any] | None:
    """Fill the front of the free list with another tenant's markers; return what was sent, or None.

    LIFO reuse hands the over-capacity request the pages freed last, so these pages are what a
    defective decode reads: another tenant's live markers there turn its 200 into a ``leak``,
    whatever traffic came before. The prompt stays under the limit (and, with its generation, inside
    the context window), and asks for enough tokens that an echoing decode writes every page the
    over-capacity request will reserve.
    """
    order = list(ctx.tenants)
    others = order[order.index(tenant) + 1 :] + order[: order.index(tenant)] if tenant in order else order
    limit = capacity.admission_limit or 0
    tokens = min(limit - PRIME_HEADROOM, PRIME_MAX_TOKENS)
    window = sized.tokens + max_tokens
    budget = max(16, min(window - tokens + PRIME_HEADROOM, max_tokens + 2 * PRIME_HEADROOM))
    # Engines that count prompt + max_tokens against the context window would refuse the prime.
    tokens = min(tokens, (capacity.context_window or limit) - budget - PRIME_HEADROOM)
    if not others or tokens < 1:
        return None
    owner = others[0]
    _, marker = ctx.markers.plant(ctx.target.name, owner)
    chars = max(1, int(tokens * len(sized.text) / sized.tokens))
    request = CompletionRequest(filler(marker, chars), max_tokens=budget, chat=False, stream=False)
    c = await ctx.complete(owner, request)
    return {"tenant": owner, "status_code": c.status, "prompt_tokens": c.prompt_tokens, "max_tokens": budget}


def _too_large(tokens: int, ceiling: int, limit: int) -> ProbeResult:
    detail = f"a prompt over the limit needs {tokens} tokens; max_prompt_tokens allows {ceiling}"
    return ProbeResult.error("prompt_too_large", detail, admission_limit=limit, prompt_tokens_sent=0)


class _Sizer:
    """Build a prompt of at least ``limit + 1`` tokens, counted where the engine can count."""

    def __init__(self, ctx: ProbeContext, tenant: str, marker: str, limit: int, margin: int):
        self.ctx, self.tenant, self.marker = ctx, tenant, marker
        self.limit, self.margin = limit, margin
        self.want, self.most = limit + 1, limit + margin
        # One character may be one token (byte tokenizers): a sample a quarter of the limit fits.
        self.sample_chars = min(CONTROL_CHARS, max(limit // 4, 1))

    async def size(self) -> Sized | ProbeResult:
        sample = filler(self.marker, self.sample_chars)
        counted = await self.ctx.target.count_tokens(sample)
        if counted:
            return await self._by_tokenizer(counted / len(sample))
        return await self._by_usage()

    async def control(self, chars: int) -> Completion:
        request = CompletionRequest(filler(self.marker, chars), max_tokens=1, chat=False, stream=False)
        return await self.ctx.complete(self.tenant, request)

    async def _by_tokenizer(self, rate: float) -> Sized | ProbeResult:
        aim = (self.want + self.most) // 2
        chars = math.ceil(aim / rate)
        tokens = 0
        text = ""
        for _ in range(MAX_SIZING_ROUNDS):
            text = filler(self.marker, chars)
            counted = await self.ctx.target.count_tokens(text)
            if counted is None:
                return ProbeResult.error("tokenize_failed", "the tokenizer stopped answering while sizing")
            tokens = counted
            if self.want <= tokens <= self.most:
                break
            rate = tokens / chars
            step = max(1, math.ceil(abs(aim - tokens) / rate))
            chars += step if tokens < self.want else -step
        if tokens < self.want:
            detail = f"{MAX_SIZING_ROUNDS} rounds reached {tokens} tokens, not {self.want}"
            return ProbeResult.error("sizing_failed", detail, admission_limit=self.limit)
        return Sized(text, tokens, counted=True)

    async def _by_usage(self) -> Sized | ProbeResult:
        """Estimate tokens per character from two small requests' usage (the slope drops BOS tokens)."""
        small, big = self.sample_chars // 2 or 1, self.sample_chars
        first, second = await self.control(small), await self.control(big)
        for c in (first, second):
            if not c.answered:
                detail = f"a small calibration prompt got no answer ({c.error_kind}: {c.status})"
                return ProbeResult.error("control_failed", redact_markers(detail))
        p1, p2 = first.prompt_tokens, second.prompt_tokens
        if p1 is None or p2 is None or p2 <= p1 or big <= small:
            detail = "no /tokenize and no usable usage.prompt_tokens: cannot size a prompt"
            return ProbeResult.error("calibration_failed", detail, admission_limit=self.limit)
        rate = (p2 - p1) / (big - small)
        overhead = max(0.0, p1 - rate * small)
        tokens = self.want + max(self.margin, math.ceil(self.limit * USAGE_SAFETY_SHARE))
        chars = math.ceil((tokens - overhead) / rate)
        return Sized(filler(self.marker, chars), tokens, counted=False)


def _verdict(c: Completion, sized: Sized, capacity: ServerCapacity, limit: int) -> ProbeResult:
    measurements: dict[str, float] = {"admission_limit": limit, "prompt_tokens_sent": sized.tokens}
    for name, value in (
        ("status_code", c.status),
        ("prompt_tokens_reported", c.prompt_tokens),
        ("latency_seconds", c.latency_seconds),
    ):
        if value is not None:
            measurements[name] = value
    evidence: dict[str, Any] = {
        "capacity": dataclasses.asdict(capacity),
        "token_count": "tokenizer" if sized.counted else "usage_estimate",
        "status_code": c.status,
        "prompt_tokens_sent": sized.tokens,
        "prompt_tokens_reported": c.prompt_tokens,
    }
    evidence["message"] = redact_markers(c.error or "")[:200]
    # Unjudgeable first: a 200 whose stream broke is an error, not an acceptance.
    if (why := unjudgeable(c)) is not None:
        detail = f"no judgeable answer to a {sized.tokens}-token prompt ({c.error_kind}: {c.status})"
        return ProbeResult(Verdict.ERROR, why, detail, evidence, measurements)
    if c.ok:
        evidence["excerpt"] = excerpt(c.text)
        detail = (
            f"HTTP {c.status} for a {sized.tokens}-token prompt over the node's limit of {limit} tokens "
            f"(the engine reported {c.prompt_tokens} prompt tokens)"
        )
        return ProbeResult(Verdict.MISMATCH, "accepted_over_capacity", detail, evidence, measurements)
    detail = f"HTTP {c.status}: refused a {sized.tokens}-token prompt over the limit of {limit}"
    return ProbeResult(Verdict.PASS, "refused_over_capacity", detail, evidence, measurements)
