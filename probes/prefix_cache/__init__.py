"""Prefix cache: does one tenant's prompt warm another tenant's KV cache?

Targets a prefix cache shared across tenants: a hit makes a later request's first token come sooner
and its ``cached_tokens`` non-zero, a side channel that tells one tenant what another sent. A
per-tenant ``cache_salt`` is the fix, and salts get lost around the engine, so isolation is
re-verified, not assumed. Every check runs on fresh random prompts (:mod:`probes.prefix_cache.prompts`):
no real tenant's data is ever read or sent, and no marker either.

- counter test (:mod:`probes.prefix_cache.counter`), where the engine reports ``cached_tokens``;
- paired salt check (:mod:`probes.prefix_cache.salts`), where it takes ``cache_salt``: by body and
  by header, tier by tier (:mod:`probes.prefix_cache.tiers`);
- timing test (:mod:`probes.prefix_cache.timing`), where no counter is reported; ``method: auto``
  starts with the counter test and falls back to timing.

Verdicts: another tenant's hit under ``policy: isolated`` is a ``leak`` (under ``policy: shared``, a
``pass`` with reason ``shared_by_policy``); a hit under another salt is a ``mismatch``; a control that
did not hit is an ``error`` ("cannot judge"), never a ``pass``, and so is a plan over
``max_tokens_per_run``, before the first request. It runs daily by default.

Each check, its statistics and its cost in full: ``docs/detection.md``, "Probe contracts in full";
the research behind it: ``docs/detection-research.md`` §1-2.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import Field, ValidationError

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict
from kvcanary.probes.prefix_cache.counter import UNOBSERVABLE, UNOBSERVABLE_DETAIL, run_counter
from kvcanary.probes.prefix_cache.prompts import PromptSize, size_prefix
from kvcanary.probes.prefix_cache.salts import SaltCheck, run_salt_check
from kvcanary.probes.prefix_cache.tiers import TierView, tier_view
from kvcanary.probes.prefix_cache.timing import judge_timing, plan_timing, run_timing
from kvcanary.probes.target import ServerCapacity

#: Engines that take vLLM's ``cache_salt`` request field: the salt check runs there by default.
SALT_ENGINES = ("vllm", "reference")
#: An HTTP header name (RFC 9110's token characters).
_HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$"
_SEVERITY = {Verdict.PASS: 0, Verdict.ERROR: 1, Verdict.MISMATCH: 2, Verdict.LEAK: 3}


class PrefixCacheOptions(ProbeOptions):
    #: ``isolated``: a cross-tenant hit is a leak; ``shared``: it is recorded as a pass (on purpose).
    policy: Literal["isolated", "shared"] = "isolated"
    method: Literal["auto", "counter", "timing"] = "auto"
    #: Tokens of the shared prefix; raised to 4 pages and capped under the admission limit.
    prefix_tokens: int = Field(1024, ge=64, le=1_000_000)
    #: Times the victim sends each prefix before another tenant does (Gu et al.'s v; the counter
    #: test sends it at least twice). Load-balanced replicas need more (v = 5 to 25 in the audit).
    victim_requests: int = Field(2, ge=1, le=25)
    alpha: float = Field(1e-8, gt=0, lt=0.5)
    #: The KS D+ the timing test must detect; it sets the trials per arm.
    min_effect: float = Field(0.5, gt=0, le=1)
    max_samples: int = Field(256, ge=5, le=2000)
    #: None: on for the engines in SALT_ENGINES, and wherever a salt header is known.
    salt_check: bool | None = None
    #: The header a gateway sets the salt in (``x-tenant-id`` for NVIDIA Dynamo); None: the one the
    #: node states (the reference worker's ``cache_salt_header``), if any.
    salt_header: str | None = Field(None, pattern=_HEADER_NAME)
    #: Room for every look of the default timing plan (about 1.22 M tokens at a 1,024-token prefix).
    max_tokens_per_run: int = Field(1_500_000, ge=1)
    #: Raw completions by default: their first page is the prompt's own noise, never a template.
    chat: bool = False


class PrefixCacheProbe(Probe):
    """Check that no tenant's prompt warms another tenant's prefix cache (see the module docstring)."""

    kind = "prefix_cache"
    options_model = PrefixCacheOptions
    default_interval_seconds = 86400.0
    # The timing test sends hundreds of requests one after another (up to 1,185 at the defaults).
    budget_timeouts = 40.0

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        try:
            opts = PrefixCacheOptions.model_validate(ctx.options)
        except ValidationError as exc:
            return ProbeResult.error("bad_options", str(exc.errors()[0]["msg"]))
        if len(ctx.tenants) < 2:
            return ProbeResult.error("too_few_tenants", "a cross-tenant audit needs at least two tenants")
        capacity = await ctx.target.capacity()
        size = await size_prefix(ctx, opts.prefix_tokens, capacity)
        if isinstance(size, str):
            return ProbeResult.error("prefix_cannot_fit", size)
        victim = secrets.choice(ctx.tenants)
        others = [t for t in ctx.tenants if t != victim]
        base: dict[str, Any] = {
            "policy": opts.policy,
            "method_asked": opts.method,
            "prefix": size.evidence(),
            "tokens_planned": 0,
        }
        if opts.method == "timing":
            result = await _timing(ctx, opts, size, victim, others, base)
        else:
            result = await _counter(ctx, opts, size, victim, others, base, capacity)
        return _finish(ctx, opts, base, result)


async def _counter(
    ctx: ProbeContext,
    opts: PrefixCacheOptions,
    size: PromptSize,
    victim: str,
    others: list[str],
    base: dict[str, Any],
    capacity: ServerCapacity | None,
) -> ProbeResult:
    """Run the counter test and the salt check; fall back to timing under ``auto`` when the engine
    reports no counter. ``base`` (the run's evidence) is filled as the checks go."""
    header = opts.salt_header or (capacity.facts.get("cache_salt_header") if capacity else None)
    salt = (
        opts.salt_check if opts.salt_check is not None else ctx.target.engine in SALT_ENGINES or bool(header)
    )
    requests = max(2, opts.victim_requests) + len(others) * (2 if opts.chat else 1)
    requests += (3 + (4 if header else 0)) if salt else 0
    base["tokens_planned"] = requests * size.request_tokens
    if base["tokens_planned"] > opts.max_tokens_per_run:
        return _over_budget("the counter test", base["tokens_planned"], opts)
    view = await tier_view(ctx, capacity, size.request_tokens) if salt else None
    reach = _reach(view, size, opts.max_tokens_per_run - base["tokens_planned"])
    base["tokens_planned"] += sum(_tier_cost(view, tier) for tier in reach) * size.request_tokens
    run = await run_counter(
        ctx, victim, others, size, victim_requests=opts.victim_requests, chat=opts.chat, policy=opts.policy
    )
    if not run.reported or run.result is None:
        base["counter"] = {"reported": False, "requests": run.rows}
        if opts.method == "counter":
            detail = f"{UNOBSERVABLE_DETAIL} (no response carried cached_tokens)"
            return ProbeResult(Verdict.ERROR, UNOBSERVABLE, detail)
        return await _timing(ctx, opts, size, victim, others, base)
    base["method"] = "counter"
    base["counter"] = {**_summary(run.result), **run.result.evidence}
    if not salt:
        base["salt_check"] = {"verdict": "skipped", "reason": "engine takes no cache_salt"}
        return _bare(run.result)
    if run.result.verdict is Verdict.ERROR:
        base["salt_check"] = {"verdict": "skipped", "reason": "the counter test could not judge"}
        return _bare(run.result)
    check = SaltCheck(ctx, victim, size, opts.chat, view, header, reach)
    checked = await run_salt_check(check)
    base["salt_check"] = {**_summary(checked), **checked.evidence}
    return _worst(run.result, checked)


def _tier_cost(view: TierView | None, tier: str) -> int:
    """Return the requests that reach ``tier``: the fresh prompts that empty the tiers above it, and two."""
    assert view is not None
    return max(view.churn[t] for t in view.present[: view.present.index(tier)]) + 2


def _reach(view: TierView | None, size: PromptSize, budget: int) -> tuple[str, ...]:
    """Return the tiers below the first that the check can reach on purpose within ``budget`` tokens:
    those whose every tier above has a known size."""
    if view is None:
        return ()
    reach: list[str] = []
    for i, tier in enumerate(view.present[1:], start=1):
        if any(t not in view.churn for t in view.present[:i]):
            break
        cost = _tier_cost(view, tier) * size.request_tokens
        if cost > budget:
            break
        reach.append(tier)
        budget -= cost
    return tuple(reach)


async def _timing(
    ctx: ProbeContext,
    opts: PrefixCacheOptions,
    size: PromptSize,
    victim: str,
    others: list[str],
    base: dict[str, Any],
) -> ProbeResult:
    """Plan and run the timing test within what the budget has left; return its verdict."""
    plan = plan_timing(
        size,
        alpha=opts.alpha,
        min_effect=opts.min_effect,
        max_samples=opts.max_samples,
        victim_requests=opts.victim_requests,
    )
    base["method"] = "timing"
    base["timing"] = {"plan": plan.evidence()}
    base["tokens_planned"] += plan.tokens
    spent = ctx.tokens["prompt"] + ctx.tokens["completion"]
    if plan.detectable_effect is None:
        detail = f"{plan.samples_per_arm} trials per arm cannot reach alpha = {opts.alpha:g} with any effect"
        return ProbeResult.error("alpha_unreachable", detail)
    if spent + plan.tokens > opts.max_tokens_per_run:
        return _over_budget("the timing test", spent + plan.tokens, opts)
    attacker = secrets.choice(others)
    result = judge_timing(
        await run_timing(ctx, plan, victim, attacker, size, chat=opts.chat),
        plan,
        victim,
        attacker,
        opts.policy,
    )
    base["timing"] = {**_summary(result), **result.evidence}
    return _bare(result)


def _over_budget(what: str, tokens: int, opts: PrefixCacheOptions) -> ProbeResult:
    detail = f"{what} would spend about {tokens} tokens, over max_tokens_per_run = {opts.max_tokens_per_run}"
    return ProbeResult.error("over_budget", detail)


def _summary(result: ProbeResult) -> dict[str, Any]:
    return {"verdict": result.verdict.value, "reason": result.reason, "detail": result.detail}


def _bare(result: ProbeResult) -> ProbeResult:
    """Return ``result`` without its evidence (already filed under its check in the run's evidence)."""
    return ProbeResult(result.verdict, result.reason, result.detail, {}, result.measurements)


def _worst(main: ProbeResult, salt: ProbeResult) -> ProbeResult:
    """Return the worse of the counter test and the salt check, with the measurements of both."""
    worst = salt if _SEVERITY[salt.verdict] > _SEVERITY[main.verdict] else main
    detail = worst.detail
    if worst is main and salt.verdict is not Verdict.PASS:
        detail += f"; the salt check also found: {salt.detail}"
    return ProbeResult(worst.verdict, worst.reason, detail, {}, {**main.measurements, **salt.measurements})


def _finish(
    ctx: ProbeContext, opts: PrefixCacheOptions, base: dict[str, Any], result: ProbeResult
) -> ProbeResult:
    """Return ``result`` with the run's evidence and its cost: the tokens planned and spent."""
    spent = ctx.tokens["prompt"] + ctx.tokens["completion"]
    evidence = {
        **base,
        **result.evidence,
        "tokens_spent": spent,
        "max_tokens_per_run": opts.max_tokens_per_run,
    }
    measurements = {
        **result.measurements,
        "tokens_planned": float(base["tokens_planned"]),
        "tokens_spent": float(spent),
        "prefix_tokens": float(base["prefix"]["prefix_tokens"]),
    }
    return ProbeResult(result.verdict, result.reason, result.detail, evidence, measurements)
