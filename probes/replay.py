"""Replay: do fixed greedy prompts still get the answers the model gave them alone, under shared load?

Targets KV faults on models that cannot follow instructions (base models, the tiny random-weight
models of the engine tests), where no nonce can be asked back: decode over pages of another request,
a prefix-cache hit on the wrong entry, KV written late into reused pages, batch slots crossed. Each
changes what a request computes, so a fixed prompt at temperature 0 stops producing its own answer.

Why an alarm means something (``docs/detection-research.md`` §5.3, with the figures): the
**baseline** is each prompt's output sent alone ``baseline_runs`` times, kept only if every run of
every prompt agrees (else ``error``, ``not_deterministic``) and none carried a foreign marker. Later
runs send each prompt ``repeats`` times, interleaved across prompts and tenants, ``concurrency`` at
a time, and test the run's deviations (outputs whose SHA-256 differs from the baseline's) against
the model's own measured rate of benign deviation, ``p0 = max(rate_floor, (D + 1) / (N + 2))``, by
an exact one-sided binomial tail (:func:`binomial_tail`): ``mismatch`` (``replay_diverged``) below
``alpha``. A run that alarms is left out of the rate, so a lasting fault keeps alarming; a run that
could not reach ``alpha`` even if all deviated is an ``error`` (``replay_powerless``), never a
pass. Any foreign marker in any output is a ``leak`` (:func:`~probes.base.judge`).

State (JSON, kept by the runner): ``version``, ``conditions`` (SHA-256 of the prompts and settings),
``rebaseline`` (the token last honoured), ``baseline`` (per prompt: ``prompt_sha256``,
``output_sha256``, ``output`` bounded to 200 characters and redacted, ``output_chars``),
``comparisons``, ``deviations``, ``runs``. ``rebaseline: true`` rebaselines on every run (a one-off
``kvcanary check``); a string rebaselines once per new value (``rebaseline: "2026-12-01 upgrade"``).
Requests are not streamed: llama-cpp-python cuts a running stream when another request arrives.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict, excerpt, unjudgeable
from kvcanary.probes.markers import redact_markers
from kvcanary.probes.target import Completion, CompletionRequest

#: Different lengths (24 to about 200 characters): at most ~200 tokens even for a byte-level tokenizer,
#: so that any context of 256 holds the longest with 32 new tokens.
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old",
    "The recipe asks for two cups of flour, one egg, a pinch of salt and warm milk. First, mix the",
    "In the spring of that year the river rose higher than anyone could remember. The bridge at the "
    "mill was closed, the market moved up the hill, and the ferryman",
    "Q: What is the boiling point of water at sea level?\nA:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
)
MAX_NEW_TOKENS = 32
#: Output kept in the state per prompt: the tenant-free reference text, bounded.
STATE_OUTPUT_CHARS = 200
STATE_VERSION = 1
#: Deviations described in the evidence; the counts cover them all.
EVIDENCE_DEVIATIONS = 8


def binomial_tail(d: int, n: int, p: float) -> float:
    """Return ``P(X >= d)`` for ``X ~ Binomial(n, p)``, exactly (terms summed in log space)."""
    if d <= 0 or p >= 1.0:
        return 1.0
    if d > n or p <= 0.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    logs = [math.log(math.comb(n, k)) + k * log_p + (n - k) * log_q for k in range(d, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * math.fsum(math.exp(x - top) for x in logs))


def rate_under_test(comparisons: int, deviations: int, floor: float) -> float:
    """Return the benign rate to test against: Laplace's estimate, never under ``floor``."""
    return max(floor, (deviations + 1) / (comparisons + 2))


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ReplayOptions(ProbeOptions):
    prompts: int = Field(4, ge=1, le=len(PROMPTS))  # how many of PROMPTS, in order
    max_tokens: int = Field(MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS)
    baseline_runs: int = Field(3, ge=2, le=10)
    repeats: int = Field(2, ge=1, le=16)  # sends of each prompt per run
    concurrency: int = Field(2, ge=1, le=16)
    alpha: float = Field(1e-6, gt=0, lt=1)
    rate_floor: float = Field(0.01, gt=0, lt=1)
    chat: bool = False  # base models have no chat template
    rebaseline: bool | str = False

    def conditions(self) -> str:
        """Return the SHA-256 of what an output depends on: another value voids the baseline."""
        spec = {"prompts": PROMPTS[: self.prompts], "max_tokens": self.max_tokens, "chat": self.chat}
        return sha256(json.dumps(spec, sort_keys=True))


@dataclass
class Sent:
    """One replayed request: which prompt, as whom, and what came back."""

    prompt: int
    tenant: str
    completion: Completion


class ReplayProbe(Probe):
    """Replay fixed greedy prompts under load; alarm when they deviate beyond the model's own rate."""

    kind = "replay"
    default_interval_seconds = 60.0
    options_model = ReplayOptions

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        opts = ReplayOptions.model_validate(ctx.options)
        if not ctx.tenants:
            return ProbeResult.error("no_tenants", "the target names no tenant to probe as")
        why = _rebaseline_reason(ctx.state, opts)
        if why is not None:
            return await _baseline(ctx, opts, why)
        return await _compare(ctx, opts)


def _rebaseline_reason(state: dict[str, Any], opts: ReplayOptions) -> str | None:
    """Return why the baseline must be (re)recorded now, or None to compare against the stored one."""
    if opts.rebaseline is True:
        return "requested"
    baseline = state.get("baseline")
    if state.get("version") != STATE_VERSION or not isinstance(baseline, list) or not baseline:
        return "no_baseline"
    if state.get("conditions") != opts.conditions() or len(baseline) != opts.prompts:
        return "conditions_changed"
    if isinstance(opts.rebaseline, str) and opts.rebaseline and state.get("rebaseline") != opts.rebaseline:
        return "requested"
    return None


def _tenant(ctx: ProbeContext, j: int, prompts: int) -> str:
    # Shifting by one each round sends neighbours (which overlap) as different tenants, and every
    # prompt as every tenant over the rounds.
    return ctx.tenants[(j + j // prompts) % len(ctx.tenants)]


def _request(opts: ReplayOptions, prompt: int) -> CompletionRequest:
    return CompletionRequest(
        PROMPTS[prompt], max_tokens=opts.max_tokens, chat=opts.chat, stream=False, temperature=0.0, seed=0
    )


async def _baseline(ctx: ProbeContext, opts: ReplayOptions, why: str) -> ProbeResult:
    """Send every prompt ``baseline_runs`` times, one at a time; keep the outputs only if all agree."""
    outputs: list[list[str]] = [[] for _ in range(opts.prompts)]
    for j in range(opts.baseline_runs * opts.prompts):
        prompt = j % opts.prompts
        c = await ctx.complete(_tenant(ctx, j, opts.prompts), _request(opts, prompt))
        if (reason := unjudgeable(c) or (None if c.ok else "refused")) is not None:
            detail = f"baseline request {j + 1} got no answer ({c.error_kind or 'http'}: {c.status})"
            return ProbeResult.error(reason, redact_markers(detail), status_code=c.status or 0)
        outputs[prompt].append(c.text)
    if ctx.leaks:
        return ProbeResult.error("baseline_tainted", "a baseline output held another tenant's marker")
    modal = [max(set(runs), key=runs.count) for runs in outputs]
    agreeing = sum(runs.count(m) for runs, m in zip(outputs, modal, strict=True))
    total = opts.baseline_runs * opts.prompts
    measurements = {"baseline_agreement": agreeing / total, "baseline_requests": float(total)}
    if agreeing < total:
        split = [i for i, runs in enumerate(outputs) if len(set(runs)) > 1]
        detail = (
            f"model is not deterministic enough to baseline: {agreeing}/{total} sequential greedy "
            f"outputs agree with their prompt's most common one (prompts {split} differ)"
        )
        return ProbeResult(Verdict.ERROR, "not_deterministic", detail, {"prompts_split": split}, measurements)
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "conditions": opts.conditions(),
        "rebaseline": opts.rebaseline if isinstance(opts.rebaseline, str) else None,
        "baseline": [_entry(PROMPTS[i], m) for i, m in enumerate(modal)],
        # The baseline's own repeats are the first evidence of the benign rate: all agreed.
        "comparisons": (opts.baseline_runs - 1) * opts.prompts,
        "deviations": 0,
        "runs": 0,
    }
    detail = f"baseline recorded ({why}): {opts.prompts} prompts, {opts.baseline_runs} agreeing runs each"
    return ProbeResult(
        Verdict.PASS, "baseline_recorded", detail, {"rebaseline_reason": why}, measurements, state
    )


def _entry(prompt: str, output: str) -> dict[str, Any]:
    return {
        "prompt_sha256": sha256(prompt),
        "output_sha256": sha256(output),
        "output": redact_markers(output[:STATE_OUTPUT_CHARS]),
        "output_chars": len(output),
    }


async def _replay(ctx: ProbeContext, opts: ReplayOptions) -> list[Sent]:
    """Send each prompt ``repeats`` times, interleaved, ``concurrency`` requests in flight at most."""
    gate = asyncio.Semaphore(opts.concurrency)

    async def send(j: int) -> Sent:
        prompt, tenant = j % opts.prompts, _tenant(ctx, j, opts.prompts)
        async with gate:
            return Sent(prompt, tenant, await ctx.complete(tenant, _request(opts, prompt)))

    return list(await asyncio.gather(*(send(j) for j in range(opts.repeats * opts.prompts))))


async def _compare(ctx: ProbeContext, opts: ReplayOptions) -> ProbeResult:
    """Replay under load and test the deviations against the model's own benign rate."""
    state = ctx.state
    sent = await _replay(ctx, opts)
    judged: list[Sent] = []
    failed: list[Sent] = []
    for s in sent:
        (judged if unjudgeable(s.completion) is None and s.completion.ok else failed).append(s)
    deviated = [
        s for s in judged if sha256(s.completion.text) != state["baseline"][s.prompt]["output_sha256"]
    ]
    n, d = len(judged), len(deviated)
    history_n, history_d = int(state.get("comparisons", 0)), int(state.get("deviations", 0))
    p0 = rate_under_test(history_n, history_d, opts.rate_floor)
    p_value = binomial_tail(d, n, p0)
    measurements: dict[str, float] = {
        "comparisons": n,
        "deviations": d,
        "p_value": p_value,
        "rate_tested": p0,
        "benign_rate": (history_d + d) / (history_n + n) if history_n + n else 0.0,
        "history_comparisons": history_n,
        "failed_requests": len(failed),
    }
    latencies = [s.completion.latency_seconds for s in sent if s.completion.latency_seconds is not None]
    if latencies:
        measurements["latency_seconds"] = max(latencies)
    evidence: dict[str, Any] = {"deviations": [_deviation(s, state) for s in deviated[:EVIDENCE_DEVIATIONS]]}
    if n and p_value < opts.alpha:
        detail = (
            f"{d} of {n} greedy replays deviated from the baseline; at the model's benign rate "
            f"{p0:.4g} that has probability {p_value:.3g} < alpha {opts.alpha:g}"
        )
        return ProbeResult(Verdict.MISMATCH, "replay_diverged", detail, evidence, measurements)
    new_state = {
        **state,
        "comparisons": history_n + n,
        "deviations": history_d + d,
        "runs": int(state.get("runs", 0)) + 1,
    }
    return _unalarmed(failed, opts.alpha, evidence, measurements, new_state)


def _unalarmed(
    failed: list[Sent], alpha: float, evidence: dict[str, Any], m: dict[str, float], state: dict[str, Any]
) -> ProbeResult:
    """Return the verdict of a run that did not alarm: an error when it could not judge, else a pass."""
    n, d, p0 = int(m["comparisons"]), int(m["deviations"]), m["rate_tested"]
    if failed:
        c = failed[0].completion
        reason = unjudgeable(c) or "refused"
        evidence["failed"] = [
            {"prompt": s.prompt, "tenant": s.tenant, "status_code": s.completion.status}
            for s in failed[:EVIDENCE_DEVIATIONS]
        ]
        detail = (
            f"{len(failed)} of {len(failed) + n} replays got no answer ({c.error_kind or 'http'}: {c.status})"
        )
        return ProbeResult(Verdict.ERROR, reason, redact_markers(detail), evidence, m, state)
    if binomial_tail(n, n, p0) >= alpha:
        detail = (
            f"{n} comparisons at the benign rate {p0:.4g} cannot reach alpha {alpha:g} even if all deviate"
        )
        return ProbeResult(Verdict.ERROR, "replay_powerless", detail, evidence, m, state)
    detail = f"{d} of {n} greedy replays deviated, within the model's benign rate {p0:.4g}"
    return ProbeResult(Verdict.PASS, "replay_consistent", detail, evidence, m, state)


def _deviation(s: Sent, state: dict[str, Any]) -> dict[str, Any]:
    """Describe one deviation: where it parted from the baseline, with short redacted excerpts."""
    entry = state["baseline"][s.prompt]
    text, kept = s.completion.text, str(entry.get("output", ""))
    common = next(
        (i for i, (a, b) in enumerate(zip(text, kept, strict=False)) if a != b), min(len(text), len(kept))
    )
    return {
        "prompt": s.prompt,
        "tenant": s.tenant,
        "baseline_sha256": entry["output_sha256"],
        "output_sha256": sha256(text),
        "common_prefix_chars": common,
        "excerpt": excerpt(text),
        "baseline_excerpt": excerpt(kept),
    }
