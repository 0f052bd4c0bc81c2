"""The counter test of the ``prefix_cache`` probe.

It reads ``usage.prompt_tokens_details.cached_tokens``, which vLLM (with
``--enable-prompt-tokens-details``), SGLang (with ``--enable-cache-report``), llama.cpp, OpenAI and
the reference worker report. vLLM and SGLang omit the field when it is 0, so an absent field means
"not reported" only when no response of the run carried it; once one did, absent is 0.

Counter test, one fresh random prefix P (:mod:`probes.prefix_cache.prompts`):

1. the victim sends P (plus a fresh tail) ``max(2, victim_requests)`` times; the first is cold;
2. control: a repeat must gain at least half of P in cached tokens over the cold request. Without
   that, caching is off or not reported and nothing after it could tell isolation from no cache:
   the run is an ``error``, never a ``pass``;
3. every other tenant sends P once. Any cached tokens gained over its baseline (0 on raw
   completions, whose first page is fresh noise; a fresh prompt of its own in chat mode, where a
   template may be cached) were computed for another tenant: the cache is shared across tenants.

The answer is deterministic: no sampling, no statistics. ``(v + tenants - 1)`` requests of one
prefix each (plus one more per other tenant in chat mode).

The paired salt check, which runs once this test's control has hit, is
:mod:`probes.prefix_cache.salts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.prefix_cache.prompts import (
    PromptSize,
    cache_request,
    cached,
    failure,
    fresh_text,
    row,
    with_tail,
)
from kvcanary.probes.target import Completion

SHARED_BY_POLICY = "shared_by_policy"
LEAK_REASON = "prefix_cache_shared_across_tenants"
UNOBSERVABLE = "cache_unobservable"
UNOBSERVABLE_DETAIL = "cannot judge: caching off or not reported"


@dataclass
class CounterRun:
    """What the counter test saw. ``reported`` is False when no victim response carried
    ``cached_tokens`` (then ``result`` is None: the caller errs, or falls back to timing)."""

    reported: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    result: ProbeResult | None = None


async def _send(
    ctx: ProbeContext, tenant: str, prompt: str, chat: bool, cache_salt: str | None = None
) -> Completion:
    return await ctx.complete(tenant, cache_request(prompt, chat=chat, stream=False, cache_salt=cache_salt))


def _failed(rows: list[dict[str, Any]], c: Completion, what: str) -> ProbeResult | None:
    why = failure(c)
    if why is None:
        return None
    detail = f"{what} got no usable answer ({why}: {c.error or f'HTTP {c.status}'})"
    return ProbeResult(Verdict.ERROR, why, detail, {"requests": rows})


async def run_counter(
    ctx: ProbeContext,
    victim: str,
    attackers: list[str],
    size: PromptSize,
    *,
    victim_requests: int,
    chat: bool,
    policy: str,
) -> CounterRun:
    """Run the counter test (see the module docstring) and return what it found."""
    prefix = fresh_text(size.letters)
    run = CounterRun(reported=False)
    sends: list[Completion] = []
    for i in range(max(2, victim_requests)):
        c = await _send(ctx, victim, with_tail(prefix), chat)
        run.rows.append(row("victim_cold" if i == 0 else "victim_repeat", victim, c))
        if (failed := _failed(run.rows, c, f"the victim's request {i + 1}")) is not None:
            run.result = failed
            return run
        sends.append(c)
    run.reported = any(c.cached_tokens is not None for c in sends)
    if not run.reported:
        return run
    gain = max(cached(c) for c in sends[1:]) - cached(sends[0])
    if gain < size.hit_tokens:
        detail = f"{UNOBSERVABLE_DETAIL} (the victim's own repeat gained {gain} cached tokens)"
        run.result = ProbeResult(Verdict.ERROR, UNOBSERVABLE, detail, {"requests": run.rows})
        return run
    gains: dict[str, int] = {}
    for tenant in attackers:
        base = 0
        if chat:  # a chat template may be cached for this tenant already: measure it on fresh text
            c = await _send(ctx, tenant, with_tail(fresh_text(size.letters)), chat)
            run.rows.append(row("attacker_baseline", tenant, c))
            if (failed := _failed(run.rows, c, f"{tenant}'s baseline request")) is not None:
                run.result = failed
                return run
            base = cached(c)
        c = await _send(ctx, tenant, with_tail(prefix), chat)
        run.rows.append(row("attacker", tenant, c))
        if (failed := _failed(run.rows, c, f"{tenant}'s request")) is not None:
            run.result = failed
            return run
        gains[tenant] = cached(c) - base
    run.result = judge_counter(victim, gain, gains, policy, run.rows)
    return run


def judge_counter(
    victim: str, control_gain: int, gains: dict[str, int], policy: str, rows: list[dict[str, Any]]
) -> ProbeResult:
    """Return the counter test's verdict from the victim's control gain and each other tenant's gain."""
    shared = sorted(t for t, g in gains.items() if g > 0)
    evidence = {
        "victim": victim,
        "control_gain_tokens": control_gain,
        "attacker_gain_tokens": gains,
        "requests": rows,
    }
    measurements = {
        "control_cached_tokens": float(control_gain),
        "cross_tenant_cached_tokens": float(max(gains.values(), default=0)),
    }
    if not shared:
        detail = f"{victim}'s prefix hit its own cache ({control_gain} tokens) and no other tenant's"
        return ProbeResult(Verdict.PASS, "prefix_cache_isolated", detail, evidence, measurements)
    detail = (
        f"{', '.join(shared)} got {max(gains[t] for t in shared)} cached tokens of a fresh prefix "
        f"only {victim} had sent: another tenant's prompt warmed this tenant's cache"
    )
    if policy == "shared":
        return ProbeResult(
            Verdict.PASS, SHARED_BY_POLICY, f"{detail} (shared by policy)", evidence, measurements
        )
    return ProbeResult(Verdict.LEAK, LEAK_REASON, detail, evidence, measurements)
