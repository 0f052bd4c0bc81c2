"""Needle: does a long prompt that the node says it can hold come back read whole, from its first token?

Targets the failures that accept a long request and then process it wrongly: the incident's
placeholder (the prompt replaced by one token, decode run over pages it never received), pages
lost or swapped on the way from prefill to decode, a KV pool too small for what admission lets in,
and silent truncation from the front. Each returns HTTP 200 with an answer that was not computed
from the request's own first pages. The probe fills the node to just under its admission limit with
a fresh nonce at the very START of the prompt and the question at the END, and asks for the nonce.

Why the check is sound:

- The nonce is a :class:`~probes.markers.MarkerBook` marker planted as the asking tenant: it can
  come back only if the request's first KV pages were computed from its own prompt and read at the
  end of a long context. Coming back to anyone else it is a ``leak`` (:func:`~probes.base.judge`).
  The filler between holds no marker, so nothing else in the prompt can stand in for it.
- The prompt stays inside capacity by construction: its size is counted by the engine's own
  tokenizer (``/tokenize``, llama-cpp-python's ``/extras/tokenize/count``) and aimed at
  ``fraction x limit - max_tokens - TEMPLATE_HEADROOM`` (within :func:`tolerance` below it), where the
  limit is the smallest of context window, KV pool and maximum request length. The headroom holds a
  chat template and the generation, for engines that count ``prompt + max_tokens`` against the
  window (vLLM). Without a tokenizer, tokens per character come from the usage of two small requests
  and the aim drops by a safety margin, so an estimate errs towards "under".
- A 200 without the nonce is a ``mismatch`` (``needle_lost``: accepted but processed wrongly), and
  so is ``usage.prompt_tokens`` under half of what was sent (``prompt_tokens_mismatch``, the
  incident's ``prompt_tokens = 1``; see :func:`probes.canary.prompt_tokens_dropped`).
- A refusal of this prompt is a wrong answer too (``refused_within_capacity``): the node stated it
  can hold it. It counts only when the size was counted, not estimated, and a small control prompt
  on the same path is answered (a path that refuses everything says nothing about capacity).
  No answer, a 5xx or an auth failure is an ``error``, never a pass.

Only models that follow instructions can pass: a base model or the tiny random-weight models the
engine tests serve answer junk, so a needle run against them is ``needle_lost`` by design. The
reference worker passes: its model echoes the prompt from position 0, so a correct read of the
first pages returns the nonce, which is why the nonce comes first. Requests are not streamed:
usage then comes back on every engine (llama-cpp-python's streams carry none).

It is expensive (a whole context per run), so it runs every 600 seconds by default and asks as one
tenant per run, in rotation (the next tenant is kept in ``ProbeResult.state``). Options: ``tenant``
(pin one), ``prompt_tokens`` (at most this many), ``fraction`` of the limit (default 1.0),
``max_tokens`` (96), ``chat`` (true).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict, excerpt, unjudgeable
from kvcanary.probes.boundary import MAX_SIZING_ROUNDS, USAGE_SAFETY_SHARE
from kvcanary.probes.canary import prompt_tokens_dropped
from kvcanary.probes.markers import marker_hash, redact_markers
from kvcanary.probes.target import Completion, CompletionRequest

#: Room for a chat template (role tags, a default system prompt) that the raw count does not see.
TEMPLATE_HEADROOM = 64
#: Enough for the 45-character nonce in any tokenizer, and for an echo that starts with it.
MAX_TOKENS = 96
#: Characters of filler in the sample that sets tokens per character before sizing.
SAMPLE_CHARS = 1024
HEAD = "{marker} is the access code; remember it.\n\n"
QUESTION = "\n\nWhat is the access code given at the very start of this text? Reply with the code only."
# Plain prose with no hex runs and no "KVC-": nothing in it can pass for a marker, whole or cut.
_FILLER = (
    "The harbor office keeps the shipping notes, the weather logs and the tide tables for the season. "
    "Clerks copy each column by hand, file the pages by month, and read them aloud at the morning "
    "meeting. Nothing in these notes is a code; they only say when the boats leave and come back.\n"
)


def filler(chars: int) -> str:
    """Return exactly ``chars`` characters of marker-free prose."""
    return (_FILLER * (chars // len(_FILLER) + 1))[: max(chars, 0)]


def needle_prompt(marker: str, chars: int) -> str:
    """Return the prompt: ``marker`` first, ``chars`` characters of filler, the question last."""
    return HEAD.format(marker=marker) + filler(chars) + QUESTION


def tolerance(target: int) -> int:
    """Return how far under ``target`` a counted prompt may end: 8 tokens, or 0.5% of a big target."""
    return max(8, target // 200)


@dataclass
class Sized:
    """A needle prompt and its size in tokens: ``counted`` by the engine's tokenizer, or estimated."""

    text: str
    tokens: int
    counted: bool


@dataclass
class Plan:
    """What one run sends: as whom, how big, and what the node said it holds (``limit``: None = unknown)."""

    tenant: str
    marker: str
    target: int
    limit: int | None
    max_tokens: int
    chat: bool

    @property
    def small_chars(self) -> int:
        """Return the filler of a small request: a fair sample, yet well inside a small node's limit."""
        return max(1, min(SAMPLE_CHARS, self.target // 4))

    def request(self, text: str, max_tokens: int) -> CompletionRequest:
        return CompletionRequest(text, max_tokens=max_tokens, chat=self.chat, stream=False)


class NeedleOptions(ProbeOptions):
    tenant: str | None = None  # ask as this tenant every run (default: each tenant in turn)
    prompt_tokens: int | None = Field(None, ge=1)  # send at most this many tokens
    fraction: float = Field(1.0, gt=0, le=1)  # of the admission limit
    max_tokens: int = Field(MAX_TOKENS, ge=1, le=8192)
    chat: bool = True


class NeedleProbe(Probe):
    """Fill the node to just under its limit, nonce first, question last; pass only if the nonce returns."""

    kind = "needle"
    verifies_suspicion = True
    default_interval_seconds = 600.0
    options_model = NeedleOptions

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        opts = NeedleOptions.model_validate(ctx.options)
        if not ctx.tenants:
            return ProbeResult.error("no_tenants", "the target names no tenant to probe as")
        turn = int(ctx.state.get("next_tenant", 0)) % len(ctx.tenants)
        tenant = opts.tenant or ctx.tenants[turn]
        state = {"next_tenant": (turn + 1) % len(ctx.tenants)}
        plan = await _plan(ctx, tenant, opts)
        if isinstance(plan, ProbeResult):
            plan.state = state
            return plan
        sized = await _size(ctx, plan)
        if isinstance(sized, ProbeResult):
            sized.state = state
            return sized
        c = await ctx.complete(tenant, plan.request(sized.text, plan.max_tokens))
        result = _verdict(c, sized, plan)
        if c.refused:
            result = await _judge_refusal(ctx, plan, sized, result)
        result.state = state
        return result


async def _plan(ctx: ProbeContext, tenant: str, opts: NeedleOptions) -> Plan | ProbeResult:
    """Return the run's plan: the target size from the node's limit and the options, or an error."""
    capacity = await ctx.target.capacity()
    limit = capacity.admission_limit if capacity else None
    caps = [opts.prompt_tokens] if opts.prompt_tokens else []
    if limit:
        caps.append(math.floor(opts.fraction * limit) - opts.max_tokens - TEMPLATE_HEADROOM)
    elif not caps:
        detail = "the node states neither its context window nor its KV pool, and no prompt_tokens is set"
        return ProbeResult.error("capacity_unknown", detail)
    _, marker = ctx.markers.plant(ctx.target.name, tenant)
    target = min(caps)
    skeleton = len(needle_prompt(marker, 0).encode())  # bytes bound the tokens of any BPE-like tokenizer
    if target < 2 * skeleton:
        detail = f"a needle of at most {target} tokens would be mostly question (limit {limit})"
        return ProbeResult.error("capacity_too_small", detail, prompt_tokens_target=max(target, 0))
    return Plan(tenant, marker, target, limit, opts.max_tokens, opts.chat)


async def _size(ctx: ProbeContext, plan: Plan) -> Sized | ProbeResult:
    """Return a needle prompt of at most ``plan.target`` tokens, counted where the engine can count."""
    sample = needle_prompt(plan.marker, SAMPLE_CHARS)
    counted = await ctx.target.count_tokens(sample)
    if counted:
        return await _by_tokenizer(ctx, plan, counted / len(sample))
    return await _by_usage(ctx, plan)


async def _by_tokenizer(ctx: ProbeContext, plan: Plan, rate: float) -> Sized | ProbeResult:
    """Count and adjust until the prompt ends within :func:`tolerance` under the target, never over."""
    target, slack = plan.target, tolerance(plan.target)
    chars = max(0, math.floor(target / rate) - len(needle_prompt(plan.marker, 0)))
    best: Sized | None = None
    for _ in range(MAX_SIZING_ROUNDS):
        text = needle_prompt(plan.marker, chars)
        tokens = await ctx.target.count_tokens(text)
        if tokens is None:
            return ProbeResult.error("tokenize_failed", "the tokenizer stopped answering while sizing")
        if tokens <= target and (best is None or tokens > best.tokens):
            best = Sized(text, tokens, counted=True)
        if target - slack <= tokens <= target:
            break
        rate = tokens / len(text)
        gap = (target - slack // 2) - tokens
        # Step down by at least one character when over, up by at least one when under.
        chars = max(0, chars + (math.floor(gap / rate) if gap < 0 else max(1, math.floor(gap / rate))))
    if best is None:
        detail = f"{MAX_SIZING_ROUNDS} rounds found no prompt of at most {target} tokens"
        return ProbeResult.error("sizing_failed", detail, prompt_tokens_target=target)
    return best


async def _by_usage(ctx: ProbeContext, plan: Plan) -> Sized | ProbeResult:
    """Estimate tokens per character from two small requests' usage, and aim under by a safety margin."""
    small, big = plan.small_chars, 2 * plan.small_chars
    first, second = await _control(ctx, plan, small), await _control(ctx, plan, big)
    for c in (first, second):
        if not c.answered:
            detail = f"a small calibration prompt got no answer ({c.error_kind}: {c.status})"
            return ProbeResult.error("control_failed", redact_markers(detail))
    p1, p2 = first.prompt_tokens, second.prompt_tokens
    if p1 is None or p2 is None or p2 <= p1:
        detail = "no tokenizer and no usable usage.prompt_tokens: cannot size a prompt"
        return ProbeResult.error("calibration_failed", detail, prompt_tokens_target=plan.target)
    rate = (p2 - p1) / (big - small)
    overhead = p1 - rate * small  # the skeleton, the template and any BOS token
    safety = max(tolerance(plan.target), math.ceil((plan.limit or plan.target) * USAGE_SAFETY_SHARE))
    tokens = plan.target - safety
    chars = math.floor((tokens - overhead) / rate)
    if chars < 1:
        return ProbeResult.error("capacity_too_small", f"{plan.target} tokens leave no room for filler")
    return Sized(needle_prompt(plan.marker, chars), tokens, counted=False)


async def _control(ctx: ProbeContext, plan: Plan, chars: int) -> Completion:
    return await ctx.complete(plan.tenant, plan.request(needle_prompt(plan.marker, chars), 1))


async def _judge_refusal(ctx: ProbeContext, plan: Plan, sized: Sized, refused: ProbeResult) -> ProbeResult:
    """Return ``refused_within_capacity`` only for a counted prompt on a path that answers a small one."""
    if plan.limit is None or not sized.counted:
        why = "the node states no limit" if plan.limit is None else "its size was estimated, not counted"
        refused.detail += f"; {why}, so the refusal is not judged"
        return refused
    control = await _control(ctx, plan, plan.small_chars)
    if not control.answered:
        refused.reason = "control_failed"
        refused.detail = "the small control prompt was refused too: the refusal says nothing about capacity"
        return refused
    refused.verdict, refused.reason = Verdict.MISMATCH, "refused_within_capacity"
    return refused


def _verdict(c: Completion, sized: Sized, plan: Plan) -> ProbeResult:
    """Judge the answer; a refusal comes back as an ``error`` for :func:`_judge_refusal` to weigh."""
    measurements: dict[str, float] = {"prompt_tokens_target": plan.target, "prompt_tokens_sent": sized.tokens}
    for name, value in (
        ("admission_limit", plan.limit),
        ("status_code", c.status),
        ("prompt_tokens_reported", c.prompt_tokens),
        ("latency_seconds", c.latency_seconds),
    ):
        if value is not None:
            measurements[name] = value
    evidence: dict[str, Any] = {
        "tenant": plan.tenant,
        "marker_sha256": marker_hash(plan.marker),
        "token_count": "tokenizer" if sized.counted else "usage_estimate",
        "status_code": c.status,
        "prompt_tokens_sent": sized.tokens,
        "prompt_tokens_reported": c.prompt_tokens,
        "finish_reason": c.finish_reason,
    }
    if (why := unjudgeable(c)) is not None:
        evidence["message"] = redact_markers(c.error or "")[:200]
        detail = f"no judgeable answer to a {sized.tokens}-token needle ({c.error_kind}: {c.status})"
        return ProbeResult(Verdict.ERROR, why, detail, evidence, measurements)
    if not c.ok:
        evidence["message"] = redact_markers(c.error or "")[:200]
        detail = f"HTTP {c.status} refused a {sized.tokens}-token prompt inside the limit of {plan.limit}"
        return ProbeResult(Verdict.ERROR, "refused", detail, evidence, measurements)
    if plan.marker not in c.text:
        evidence["excerpt"] = excerpt(c.text)
        detail = (
            f"HTTP {c.status} for a {sized.tokens}-token prompt, but the nonce at its start did not come back"
        )
        return ProbeResult(Verdict.MISMATCH, "needle_lost", detail, evidence, measurements)
    if prompt_tokens_dropped(sized.tokens, c.prompt_tokens):
        detail = f"the engine reported {c.prompt_tokens} prompt tokens for {sized.tokens} sent"
        return ProbeResult(Verdict.MISMATCH, "prompt_tokens_mismatch", detail, evidence, measurements)
    detail = f"the nonce came back from the start of a {sized.tokens}-token prompt"
    return ProbeResult(Verdict.PASS, "needle_found", detail, evidence, measurements)
