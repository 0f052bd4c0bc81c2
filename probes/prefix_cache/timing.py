"""The timing test of the ``prefix_cache`` probe, for engines that report no cache counter.

Gu et al.'s audit (docs/detection-research.md §1) on time to first token (TTFT), made paired:

- a *hit trial*: the victim sends a fresh prefix ``victim_requests`` times, then the attacker sends
  it (``cross``: a hit only if the cache is shared across tenants), then sends it again
  (``repeat``: the attacker's own hit, the control);
- a *miss trial*: the attacker sends a fresh prefix of the same size (``miss``).

``n`` trials of each kind are shuffled together (``secrets.SystemRandom``) and sent one at a time,
so drifts in load fall on both arms alike, and the arms are compared with the one-sided two-sample
KS test of :mod:`probes.stats` (``cross`` faster than ``miss``; ``repeat`` faster than ``miss``).
Every compared sample is the attacker's own, so a difference between tenants' paths (keys, quotas,
routes) cannot pass for a hit.

Verdicts, at significance ``alpha`` (default 1e-8) and effect ``min_effect`` (default D = 0.5):

- ``cross`` faster (p < alpha and D >= min_effect): the attacker's first request of another tenant's
  prefix was served from cache: ``leak`` (or a pass, ``shared_by_policy``);
- otherwise, ``repeat`` faster: hits are visible on this path and the cross arm showed none: ``pass``;
- otherwise: hits are not visible at this sample size (caching off, or too little prefill for the
  noise): ``error``, never a pass.

False alarms: under isolation ``cross`` and ``miss`` requests are both misses of fresh prefixes of
one size, shuffled, so their times are exchangeable and the exact test's false-alarm rate is at most
``alpha`` per run (1e-8: once in 270,000 years of daily runs). Measured against an isolated
reference worker: 0 leaks in 130 runs (100 at 19 trials per arm, 30 at 74), the cross arm's p below
0.05 in 3 of 100 runs and never below 0.01 (``tests/probes/test_prefix_cache.py`` repeats 10 runs).

Cost: ``n * (victim_requests + 3)`` requests of one prefix each, one completion token each:
381,840 tokens spent at the defaults (1,024-token prefix, D = 0.5 so n = 74, v = 2).

Power: hits must cost visibly less than misses. On the reference worker a 64 Ki-token prefix
(miss ~0.18 s, hit ~0.04 s) gives D = 0.9 to 1; at 1,024 tokens the medians differ by 1 to 3 ms in
~10 ms of noise and the control mostly fails, so the verdict is ``error``, not a false ``pass``.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.prefix_cache.counter import (
    LEAK_REASON,
    SHARED_BY_POLICY,
    UNOBSERVABLE,
    UNOBSERVABLE_DETAIL,
)
from kvcanary.probes.prefix_cache.prompts import PromptSize, cache_request, failure, fresh_text, with_tail
from kvcanary.probes.stats import KsResult, ks_greater, median, min_detectable_effect, samples_per_arm
from kvcanary.probes.target import Completion

#: Above this share of failed trials the arms may be biased by what failed: no verdict.
MAX_FAILED_SHARE = 0.1
#: Requests of a hit trial beyond the victim's: the attacker's cross request and its repeat.
_ATTACKER_REQUESTS = 2


@dataclass(frozen=True)
class TimingPlan:
    """How many trials of each kind a timing run makes, and what that costs and can detect."""

    samples_per_arm: int
    wanted_per_arm: int
    victim_requests: int
    request_tokens: int
    alpha: float
    min_effect: float
    #: The smallest D+ whose exact p reaches ``alpha`` with these arms; None: unreachable.
    detectable_effect: float | None

    @property
    def requests(self) -> int:
        return self.samples_per_arm * (self.victim_requests + _ATTACKER_REQUESTS + 1)

    @property
    def tokens(self) -> int:
        return self.requests * self.request_tokens

    def evidence(self) -> dict[str, Any]:
        return {
            "samples_per_arm": self.samples_per_arm,
            "samples_per_arm_wanted": self.wanted_per_arm,
            "victim_requests": self.victim_requests,
            "requests_planned": self.requests,
            "tokens_planned": self.tokens,
            "alpha": self.alpha,
            "min_effect": self.min_effect,
            "detectable_effect": self.detectable_effect,
        }


def plan_timing(
    size: PromptSize, *, alpha: float, min_effect: float, max_samples: int, victim_requests: int
) -> TimingPlan:
    """Return the plan: ``ceil(ln(1/alpha) / min_effect^2)`` trials per arm, at most ``max_samples``."""
    wanted = samples_per_arm(alpha, min_effect)
    n = min(wanted, max_samples)
    return TimingPlan(
        n, wanted, victim_requests, size.request_tokens, alpha, min_effect, min_detectable_effect(alpha, n)
    )


@dataclass
class TimingRun:
    """The seconds each arm measured (TTFT, or the whole latency of a one-token answer when the
    stream showed no first token), and the trials lost to failed requests."""

    cross: list[float] = field(default_factory=list)
    repeat: list[float] = field(default_factory=list)
    miss: list[float] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)
    ttft_missing: int = 0
    seconds: float = 0.0


def _seconds(run: TimingRun, c: Completion) -> float | None:
    if failure(c) is not None:
        run.failed[failure(c) or ""] = run.failed.get(failure(c) or "", 0) + 1
        return None
    if c.ttft_seconds is None:
        run.ttft_missing += 1
    return c.ttft_seconds if c.ttft_seconds is not None else c.latency_seconds


async def _timed(ctx: ProbeContext, run: TimingRun, tenant: str, prompt: str, chat: bool) -> float | None:
    return _seconds(run, await ctx.complete(tenant, cache_request(prompt, chat=chat, stream=True)))


async def _hit_trial(
    ctx: ProbeContext,
    run: TimingRun,
    plan: TimingPlan,
    victim: str,
    attacker: str,
    size: PromptSize,
    chat: bool,
) -> None:
    prefix = fresh_text(size.letters)
    for _ in range(plan.victim_requests):
        if await _timed(ctx, run, victim, with_tail(prefix), chat) is None:
            return  # an unwarmed prefix would make a miss look like isolation
    cross = await _timed(ctx, run, attacker, with_tail(prefix), chat)
    repeat = await _timed(ctx, run, attacker, with_tail(prefix), chat)
    if cross is not None and repeat is not None:
        run.cross.append(cross)
        run.repeat.append(repeat)


async def run_timing(
    ctx: ProbeContext, plan: TimingPlan, victim: str, attacker: str, size: PromptSize, *, chat: bool
) -> TimingRun:
    """Run the plan's trials, shuffled, one request at a time; return the arms' seconds."""
    trials = ["hit"] * plan.samples_per_arm + ["miss"] * plan.samples_per_arm
    secrets.SystemRandom().shuffle(trials)
    run, started = TimingRun(), time.monotonic()
    for trial in trials:
        if trial == "hit":
            await _hit_trial(ctx, run, plan, victim, attacker, size, chat)
        elif (
            seconds := await _timed(ctx, run, attacker, with_tail(fresh_text(size.letters)), chat)
        ) is not None:
            run.miss.append(seconds)
    run.seconds = time.monotonic() - started
    return run


def _significant(result: KsResult, plan: TimingPlan) -> bool:
    return result.pvalue < plan.alpha and result.statistic >= plan.min_effect


def _ks_evidence(result: KsResult) -> dict[str, Any]:
    return {
        "d": result.statistic,
        "p": result.pvalue,
        "n": [result.n_first, result.n_second],
        "method": result.method,
    }


def judge_timing(run: TimingRun, plan: TimingPlan, victim: str, attacker: str, policy: str) -> ProbeResult:
    """Return the timing test's verdict (see the module docstring) with D, p, n and the arms' medians."""
    lost = plan.samples_per_arm - min(len(run.cross), len(run.miss))
    evidence: dict[str, Any] = {
        "victim": victim,
        "attacker": attacker,
        "plan": plan.evidence(),
        "failed_requests": run.failed,
        "ttft_missing": run.ttft_missing,
    }
    if lost > MAX_FAILED_SHARE * plan.samples_per_arm or not run.cross or not run.miss:
        detail = f"{lost} of {plan.samples_per_arm} trials per arm failed ({run.failed}): no fair comparison"
        return ProbeResult(Verdict.ERROR, "requests_failed", detail, evidence)
    cross, control = ks_greater(run.cross, run.miss), ks_greater(run.repeat, run.miss)
    evidence.update(cross=_ks_evidence(cross), control=_ks_evidence(control))
    medians = {"cross": median(run.cross), "repeat": median(run.repeat), "miss": median(run.miss)}
    evidence["median_seconds"] = medians
    # The raw arms, to the 0.1 ms: enough to recompute any statistic later, small enough to keep.
    evidence["samples_ms"] = {
        arm: [round(1000 * v, 1) for v in values]
        for arm, values in (("cross", run.cross), ("repeat", run.repeat), ("miss", run.miss))
    }
    measurements = {
        "ks_d": cross.statistic,
        "ks_p": cross.pvalue,
        "samples_per_arm": float(min(cross.n_first, cross.n_second)),
        "control_ks_d": control.statistic,
        "control_ks_p": control.pvalue,
        "ttft_cross_median_seconds": medians["cross"],
        "ttft_repeat_median_seconds": medians["repeat"],
        "ttft_miss_median_seconds": medians["miss"],
        "timing_seconds": run.seconds,
    }
    said = f"D = {cross.statistic:.3f}, p = {cross.pvalue:.3g}, n = {cross.n_first}/{cross.n_second}"
    if _significant(cross, plan):
        detail = (
            f"{attacker}'s first request of {victim}'s fresh prefixes came back faster than its misses "
            f"({said}; medians {medians['cross']:.4f} s vs {medians['miss']:.4f} s)"
        )
        if policy == "shared":
            return ProbeResult(
                Verdict.PASS, SHARED_BY_POLICY, f"{detail} (shared by policy)", evidence, measurements
            )
        return ProbeResult(Verdict.LEAK, LEAK_REASON, detail, evidence, measurements)
    if _significant(control, plan):
        detail = (
            f"{attacker}'s own repeats hit (D = {control.statistic:.3f}, p = {control.pvalue:.3g}) "
            f"but {victim}'s prefixes did not ({said})"
        )
        return ProbeResult(Verdict.PASS, "prefix_cache_isolated", detail, evidence, measurements)
    detail = (
        f"{UNOBSERVABLE_DETAIL}: even {attacker}'s own repeats were not faster "
        f"(D = {control.statistic:.3f}, p = {control.pvalue:.3g}; cross {said})"
    )
    return ProbeResult(Verdict.ERROR, UNOBSERVABLE, detail, evidence, measurements)
