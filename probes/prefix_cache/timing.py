"""The timing test of the ``prefix_cache`` probe, for engines that report no cache counter.

Gu et al.'s audit on time to first token (TTFT), made paired and group-sequential
(``docs/detection-research.md`` §1, where the plan, the false-alarm bound, power and cost are
derived and measured):

- a *hit trial*: the victim sends a fresh prefix ``victim_requests`` times, then the attacker sends
  it (``cross``: a hit only if the cache is shared across tenants), then sends it again
  (``repeat``: the attacker's own hit);
- a *miss trial*: the attacker sends a fresh prefix of the same size (``miss``).

The plan (:func:`plan_timing`) is fixed before the first request: up to :data:`LOOKS` looks of
``b = ceil(ln(looks / alpha) / min_effect^2)`` more trials of each kind, all shuffled together once
(``secrets.SystemRandom``) and sent one at a time. Each look runs three one-sided two-sample KS
tests (:mod:`probes.stats`) on every trial so far, each at ``alpha / looks``: ``cross`` faster than
``miss`` is a ``leak`` (a pass, ``shared_by_policy``, under policy ``shared``); else ``repeat``
faster than ``miss`` *and* than ``cross`` is a ``pass``; else the next look, and after the last an
``error`` (``cache_unobservable`` or ``timing_inconclusive``), never a pass. Every compared sample
is the attacker's own, so a difference between tenants' paths cannot pass for a hit, and a run says
``leak`` falsely with probability at most ``alpha`` whatever the stopping rule (a union bound over
the looks). Its cost is bounded before the first request: at most ``looks * b * (victim_requests +
3)`` requests of one prefix each (the plan's ``requests_planned`` and ``tokens_planned``).
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

#: The most looks a plan takes: each adds a batch of trials and splits alpha once more.
LOOKS = 3
#: Above this share of failed trials of either kind the arms may be biased by what failed: no verdict.
MAX_FAILED_SHARE = 0.1
#: Requests of a hit trial beyond the victim's: the attacker's cross request and its repeat.
_ATTACKER_REQUESTS = 2
#: The reason of a run whose repeats hit but whose cross arm was neither decisively a hit nor a miss.
INCONCLUSIVE = "timing_inconclusive"


@dataclass(frozen=True)
class TimingPlan:
    """How a timing run samples, fixed before its first request: up to ``looks`` looks, each after
    ``trials_per_look`` more trials of each kind and at ``alpha / looks``; what it costs at most and
    what it can detect."""

    #: The most trials of each kind: ``looks * trials_per_look``.
    samples_per_arm: int
    #: What :data:`LOOKS` looks would have taken before ``max_samples`` capped the plan.
    wanted_per_arm: int
    victim_requests: int
    request_tokens: int
    alpha: float
    min_effect: float
    #: The smallest D+ whose exact p reaches ``alpha_per_look`` at the first look, with equal arms;
    #: None: unreachable.
    detectable_effect: float | None
    looks: int
    trials_per_look: int

    @property
    def alpha_per_look(self) -> float:
        return self.alpha / self.looks

    @property
    def requests(self) -> int:
        """Return the requests of every look: the most a run sends."""
        return self.samples_per_arm * (self.victim_requests + _ATTACKER_REQUESTS + 1)

    @property
    def tokens(self) -> int:
        return self.requests * self.request_tokens

    def evidence(self) -> dict[str, Any]:
        detectable = [
            min_detectable_effect(self.alpha_per_look, k * self.trials_per_look)
            for k in range(1, self.looks + 1)
        ]
        return {
            "samples_per_arm": self.samples_per_arm,
            "samples_per_arm_wanted": self.wanted_per_arm,
            "looks": self.looks,
            "trials_per_look": self.trials_per_look,
            "victim_requests": self.victim_requests,
            "requests_planned": self.requests,
            "tokens_planned": self.tokens,
            "alpha": self.alpha,
            "alpha_per_look": self.alpha_per_look,
            "min_effect": self.min_effect,
            "detectable_effect": self.detectable_effect,
            "detectable_effect_by_look": detectable,
        }


def plan_timing(
    size: PromptSize,
    *,
    alpha: float,
    min_effect: float,
    max_samples: int,
    victim_requests: int,
    looks: int = LOOKS,
) -> TimingPlan:
    """Return the plan: the most looks, up to ``looks``, whose trials fit ``max_samples`` per arm,
    each after ``ceil(ln(kept / alpha) / min_effect^2)`` more trials of each kind (``kept``: the looks
    kept); one look of ``max_samples`` trials when not even one full look fits."""
    wanted = looks * samples_per_arm(alpha / looks, min_effect)
    kept, batch = 1, max_samples
    for k in range(looks, 0, -1):
        if k * samples_per_arm(alpha / k, min_effect) <= max_samples:
            kept, batch = k, samples_per_arm(alpha / k, min_effect)
            break
    return TimingPlan(
        samples_per_arm=kept * batch,
        wanted_per_arm=wanted,
        victim_requests=victim_requests,
        request_tokens=size.request_tokens,
        alpha=alpha,
        min_effect=min_effect,
        detectable_effect=min_detectable_effect(alpha / kept, batch),
        looks=kept,
        trials_per_look=batch,
    )


@dataclass(frozen=True)
class Look:
    """One look of a run: its three tests on every trial gathered so far, at ``alpha`` each.

    ``cross``: the cross arm faster than the misses; ``control``: the repeats faster than the misses;
    ``separation``: the repeats faster than the cross arm.
    """

    number: int
    hit_trials: int
    miss_trials: int
    alpha: float
    cross: KsResult
    control: KsResult
    separation: KsResult

    @property
    def leak(self) -> bool:
        """Return True when the cross arm was decisively faster than the misses."""
        return self.cross.pvalue < self.alpha

    @property
    def isolated(self) -> bool:
        """Return True when the repeats were decisively faster than both the misses and the cross arm."""
        return self.control.pvalue < self.alpha and self.separation.pvalue < self.alpha

    @property
    def decided(self) -> bool:
        return self.leak or self.isolated

    def evidence(self) -> dict[str, Any]:
        decision = "cross_faster" if self.leak else "isolated" if self.isolated else None
        return {
            "look": self.number,
            "trials": {"hit": self.hit_trials, "miss": self.miss_trials},
            "alpha": self.alpha,
            "cross": _ks_evidence(self.cross),
            "control": _ks_evidence(self.control),
            "separation": _ks_evidence(self.separation),
            "decided": decision,
        }


@dataclass
class TimingRun:
    """What a run measured: the seconds of each arm (TTFT, or the whole latency of a one-token answer
    when the stream showed no first token), the trials begun of each kind and those lost to failed
    requests, the requests sent and tokens spent, and the looks taken."""

    cross: list[float] = field(default_factory=list)
    repeat: list[float] = field(default_factory=list)
    miss: list[float] = field(default_factory=list)
    hit_trials: int = 0
    miss_trials: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    ttft_missing: int = 0
    requests: int = 0
    tokens: int = 0
    looks: list[Look] = field(default_factory=list)
    seconds: float = 0.0

    def unfair(self) -> str | None:
        """Return which arm lost more than :data:`MAX_FAILED_SHARE` of its trials (a phrase), or None."""
        arms = (("hit", len(self.cross), self.hit_trials), ("miss", len(self.miss), self.miss_trials))
        for arm, kept, begun in arms:
            if not kept or begun - kept > MAX_FAILED_SHARE * begun:
                return f"{begun - kept} of {begun} {arm} trials"
        return None


def _seconds(run: TimingRun, c: Completion) -> float | None:
    if (why := failure(c)) is not None:
        run.failed[why] = run.failed.get(why, 0) + 1
        return None
    if c.ttft_seconds is None:
        run.ttft_missing += 1
    return c.ttft_seconds if c.ttft_seconds is not None else c.latency_seconds


async def _timed(ctx: ProbeContext, run: TimingRun, tenant: str, prompt: str, chat: bool) -> float | None:
    run.requests += 1
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
    run.hit_trials += 1
    prefix = fresh_text(size.letters)
    for _ in range(plan.victim_requests):
        if await _timed(ctx, run, victim, with_tail(prefix), chat) is None:
            return  # an unwarmed prefix would make a miss look like isolation
    cross = await _timed(ctx, run, attacker, with_tail(prefix), chat)
    repeat = await _timed(ctx, run, attacker, with_tail(prefix), chat)
    if cross is not None and repeat is not None:
        run.cross.append(cross)
        run.repeat.append(repeat)


async def _miss_trial(ctx: ProbeContext, run: TimingRun, attacker: str, size: PromptSize, chat: bool) -> None:
    run.miss_trials += 1
    if (seconds := await _timed(ctx, run, attacker, with_tail(fresh_text(size.letters)), chat)) is not None:
        run.miss.append(seconds)


def take_look(run: TimingRun, plan: TimingPlan, number: int) -> Look:
    """Return look ``number``'s tests on every trial of ``run`` so far (both arms must hold values)."""
    return Look(
        number,
        run.hit_trials,
        run.miss_trials,
        plan.alpha_per_look,
        cross=ks_greater(run.cross, run.miss),
        control=ks_greater(run.repeat, run.miss),
        separation=ks_greater(run.repeat, run.cross),
    )


async def run_timing(
    ctx: ProbeContext, plan: TimingPlan, victim: str, attacker: str, size: PromptSize, *, chat: bool
) -> TimingRun:
    """Run the plan's trials, shuffled once as a whole, one request at a time, taking a look after
    each look's share; stop at the first look that decides, or once an arm lost too many trials."""
    trials = ["hit"] * plan.samples_per_arm + ["miss"] * plan.samples_per_arm
    secrets.SystemRandom().shuffle(trials)
    run, started = TimingRun(), time.monotonic()
    spent_before = ctx.tokens["prompt"] + ctx.tokens["completion"]
    share = 2 * plan.trials_per_look
    for number in range(1, plan.looks + 1):
        for trial in trials[(number - 1) * share : number * share]:
            if trial == "hit":
                await _hit_trial(ctx, run, plan, victim, attacker, size, chat)
            else:
                await _miss_trial(ctx, run, attacker, size, chat)
        if run.unfair() is not None:
            break
        run.looks.append(take_look(run, plan, number))
        if run.looks[-1].decided:
            break
    run.seconds = time.monotonic() - started
    run.tokens = ctx.tokens["prompt"] + ctx.tokens["completion"] - spent_before
    return run


def _ks_evidence(result: KsResult) -> dict[str, Any]:
    return {
        "d": result.statistic,
        "p": result.pvalue,
        "n": [result.n_first, result.n_second],
        "method": result.method,
    }


def _num(value: float) -> str:
    """Return ``value`` to two significant digits, exponents unpadded (4.5e-9, not 4.5e-09)."""
    return f"{value:.2g}".replace("e-0", "e-").replace("e+0", "e+")


def _said(result: KsResult) -> str:
    return f"D = {result.statistic:.3f}, p = {_num(result.pvalue)}, n = {result.n_first}/{result.n_second}"


def _short_of(result: KsResult, alpha: float) -> str:
    """Return the failed threshold of one test in plain words: its p, what it needed, its D and n."""
    return (
        f"p = {_num(result.pvalue)}, needs < {_num(alpha)} "
        f"(D = {result.statistic:.3f}, n = {result.n_first}/{result.n_second})"
    )


def _evidence(run: TimingRun, plan: TimingPlan, victim: str, attacker: str) -> dict[str, Any]:
    """Return the run's evidence: the plan, every look taken, what was spent and lost, the raw arms."""
    return {
        "victim": victim,
        "attacker": attacker,
        "plan": plan.evidence(),
        "looks_taken": len(run.looks),
        "looks": [look.evidence() for look in run.looks],
        "trials": {"hit": run.hit_trials, "miss": run.miss_trials},
        "requests_sent": run.requests,
        "tokens_spent": run.tokens,
        "failed_requests": run.failed,
        "ttft_missing": run.ttft_missing,
        # The raw arms, to the 0.1 ms: enough to recompute any statistic later, small enough to keep.
        "samples_ms": {
            arm: [round(1000 * v, 1) for v in values]
            for arm, values in (("cross", run.cross), ("repeat", run.repeat), ("miss", run.miss))
        },
    }


def _measurements(run: TimingRun, look: Look) -> dict[str, float]:
    return {
        "ks_d": look.cross.statistic,
        "ks_p": look.cross.pvalue,
        "samples_per_arm": float(min(look.cross.n_first, look.cross.n_second)),
        "control_ks_d": look.control.statistic,
        "control_ks_p": look.control.pvalue,
        "separation_ks_d": look.separation.statistic,
        "separation_ks_p": look.separation.pvalue,
        "timing_looks": float(look.number),
        "timing_requests": float(run.requests),
        "ttft_cross_median_seconds": median(run.cross),
        "ttft_repeat_median_seconds": median(run.repeat),
        "ttft_miss_median_seconds": median(run.miss),
        "timing_seconds": run.seconds,
    }


def judge_timing(run: TimingRun, plan: TimingPlan, victim: str, attacker: str, policy: str) -> ProbeResult:
    """Return the timing test's verdict from the run's last look (see the module docstring), with
    every look's D, p and n, the arms' medians and what the run spent."""
    evidence = _evidence(run, plan, victim, attacker)
    if (lost := run.unfair()) is not None:
        detail = f"{lost} failed by look {len(run.looks) + 1} ({run.failed}): no fair comparison"
        return ProbeResult(Verdict.ERROR, "requests_failed", detail, evidence)
    look = run.looks[-1]
    evidence.update(cross=_ks_evidence(look.cross), control=_ks_evidence(look.control))
    evidence["median_seconds"] = {
        "cross": median(run.cross),
        "repeat": median(run.repeat),
        "miss": median(run.miss),
    }
    verdict, reason, detail = _verdict(look, plan, victim, attacker, policy)
    return ProbeResult(verdict, reason, detail, evidence, _measurements(run, look))


def _verdict(
    look: Look, plan: TimingPlan, victim: str, attacker: str, policy: str
) -> tuple[Verdict, str, str]:
    """Return the verdict, reason and detail of a run whose last look was ``look``."""
    at = f"look {look.number} of {plan.looks}"
    if look.leak:
        detail = (
            f"{attacker}'s first requests of {victim}'s fresh prefixes came back faster than its misses "
            f"({_said(look.cross)} < {_num(look.alpha)} at {at})"
        )
        if policy == "shared":
            return Verdict.PASS, SHARED_BY_POLICY, f"{detail} (shared by policy)"
        return Verdict.LEAK, LEAK_REASON, detail
    if look.isolated:
        detail = (
            f"{attacker}'s own repeats came back faster than its misses ({_said(look.control)}) and than "
            f"its first requests of {victim}'s prefixes ({_said(look.separation)}), which were no faster "
            f"than its misses ({_said(look.cross)}) at {at}"
        )
        return Verdict.PASS, "prefix_cache_isolated", detail
    if look.control.pvalue >= look.alpha:
        detail = (
            f"{UNOBSERVABLE_DETAIL}: {attacker}'s own repeats were not decisively faster than its misses: "
            f"{_short_of(look.control, look.alpha)} after {at}; cross arm {_said(look.cross)}"
        )
        return Verdict.ERROR, UNOBSERVABLE, detail
    detail = (
        f"cannot judge: {attacker}'s own repeats were faster than its misses ({_said(look.control)}), but "
        f"its first requests of {victim}'s prefixes were neither decisively faster than its misses "
        f"({_short_of(look.cross, look.alpha)}) nor decisively slower than its repeats "
        f"({_short_of(look.separation, look.alpha)}) after {at}: a cache shared for some requests, "
        "or too little contrast for the plan"
    )
    return Verdict.ERROR, INCONCLUSIVE, detail
