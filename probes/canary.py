"""Canary: does every tenant get its own secret back, intact, through the serving path?

Targets: a serving path that decodes a request over KV it does not own, or over none of it: the
incident's one-token placeholder decoded over stale pages, and the answer held someone else's text
instead of what the request asked. The check asks each tenant's model to repeat a fresh nonce.

Why the check is sound (``docs/detection-research.md`` §5):

- The nonce is a :class:`~probes.markers.MarkerBook` marker (128 bits sealed by the monitor's
  key), planted as the asking tenant. Coming back to that tenant it proves the request's own KV
  was read; coming back to anyone else it is a leak (:func:`~probes.base.judge`), which no model
  produces by chance.
- The task is self-referential, short (one 45-character code, well before the ~100th token where
  nondeterministic runs diverge) and greedy (temperature 0, seed 0): nondeterminism changes late
  tokens of long answers, not a short copy. A 200 without the nonce is therefore a wrong answer
  (``mismatch``), never hidden behind the status code.
- ``usage.prompt_tokens`` is compared with the engine's own count of what was sent: the incident
  reported 1 prompt token for a huge prompt. A report under half of what was sent is a ``mismatch``
  (a chat template only adds tokens, so honest reports are at or above the raw count).

Every tenant is asked in every run, one after another: each tenant's path (key, quota, cache salt)
can break on its own, so a rotation would leave a broken tenant unseen for several intervals, and
sequential requests keep each tenant's latency and time to first token free of the others' load.
A 4xx refusal of this tiny prompt is an ``error``: the probe could not judge the output (a wrong
model name or parameter, not a KV fault); long-lasting errors raise their own warning incident.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict, excerpt, unjudgeable
from kvcanary.probes.base import (
    prompt_tokens_dropped as prompt_tokens_dropped,
)
from kvcanary.probes.markers import marker_hash, redact_markers
from kvcanary.probes.target import Completion, CompletionRequest

#: Short on purpose: the reference worker echoes its prompt from position 0, real models copy it.
REPEAT_PROMPT = "Repeat this code exactly, with nothing else: {marker}"
#: Enough for an echoing model to reach past the nonce (the prompt is 90 characters).
MAX_TOKENS = 96
_SEVERITY = {Verdict.LEAK: 3, Verdict.MISMATCH: 2, Verdict.ERROR: 1, Verdict.PASS: 0}


#: How long one count of the canary prompt's tokens is trusted: a tokenizer changes only with the model.
COUNT_TTL_SECONDS = 600.0
PROMPT_CHARS = len(REPEAT_PROMPT.format(marker="KVC-00000000-" + "0" * 32))


def _counted(state: dict[str, Any], now: float) -> int | None:
    """Return the prompt's token count kept in state, while it is fresh and for this prompt's shape."""
    count, at = state.get("prompt_tokens"), state.get("counted_at")
    if (
        not isinstance(count, int)
        or not isinstance(at, int | float)
        or state.get("prompt_chars") != PROMPT_CHARS
    ):
        return None
    return count if 0 <= now - at < COUNT_TTL_SECONDS else None


def repeat_prompt(marker: str) -> str:
    """Return the prompt that asks a model to repeat ``marker``."""
    return REPEAT_PROMPT.format(marker=marker)


@dataclass
class TenantCheck:
    """One tenant's canary: what it sent, what came back, and what that means."""

    tenant: str
    marker_id: str
    digest: str
    sent_tokens: int | None
    completion: Completion
    verdict: Verdict
    reason: str
    detail: str
    #: Which step of a run with several (a trigger kind's rounds) sent the request.
    step: str | None = None

    def evidence(self) -> dict[str, Any]:
        c = self.completion
        out: dict[str, Any] = {
            "tenant": self.tenant,
            **({"step": self.step} if self.step else {}),
            "marker_id": self.marker_id,
            "marker_sha256": self.digest,
            "verdict": self.verdict.value,
            "reason": self.reason,
            "status_code": c.status,
            "prompt_tokens_sent": self.sent_tokens,
            "prompt_tokens_reported": c.prompt_tokens,
            "finish_reason": c.finish_reason,
        }
        if self.verdict is not Verdict.PASS:
            out["excerpt"] = excerpt(c.text)
            out["error"] = redact_markers(c.error or "")
        return out


class CanaryOptions(ProbeOptions):
    # Reasoning models may need more room before they repeat the nonce.
    max_tokens: int = Field(MAX_TOKENS, ge=1, le=8192)
    chat: bool = True
    # Streams measure time to first token, but some servers (llama-cpp-python) send no usage in a
    # stream, and without usage the prompt-token check cannot run: set false for those.
    stream: bool = True


class CanaryProbe(Probe):
    """Ask every tenant to repeat its own fresh nonce; judge the answer, not the status code."""

    kind = "canary"
    verifies_suspicion = True
    options_model = CanaryOptions

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        counted = _counted(ctx.state, time.time())
        checks = []
        for tenant in ctx.tenants:
            check = await self.check(ctx, tenant, counted)
            counted = check.sent_tokens if counted is None else counted
            checks.append(check)
        result = combine(checks)
        if counted is not None and _counted(ctx.state, time.time()) is None:
            result.state = {"prompt_tokens": counted, "counted_at": time.time(), "prompt_chars": PROMPT_CHARS}
        return result

    async def check(self, ctx: ProbeContext, tenant: str, counted: int | None = None) -> TenantCheck:
        """Plant a nonce as ``tenant``, ask for it back, and judge the answer.

        ``counted`` is the engine's token count of a canary prompt when one is known: every canary
        prompt has the same shape and length, so one count serves every tenant for a while.
        """
        marker_id, marker = ctx.markers.plant(ctx.target.name, tenant)
        prompt = repeat_prompt(marker)
        sent = counted if counted is not None else await ctx.target.count_tokens(prompt)
        c = await ctx.complete(tenant, canary_request(ctx, prompt), sent_tokens=sent)
        verdict, reason, detail = judge_answer(c, prompt, marker, sent)
        return TenantCheck(tenant, marker_id, marker_hash(marker), sent, c, verdict, reason, detail)


def canary_request(ctx: ProbeContext, prompt: str, request_id: str | None = None) -> CompletionRequest:
    """Return the canary's request for ``prompt``: greedy, short, as the kind's options say."""
    return CompletionRequest(
        prompt=prompt,
        max_tokens=int(ctx.options.get("max_tokens", MAX_TOKENS)),
        chat=bool(ctx.options.get("chat", True)),
        stream=bool(ctx.options.get("stream", True)),
        temperature=0.0,
        seed=0,
        request_id=request_id,
    )


def judge_answer(c: Completion, prompt: str, marker: str, sent: int | None) -> tuple[Verdict, str, str]:
    if (why := unjudgeable(c)) is not None:
        said = redact_markers(c.error or f"HTTP {c.status}")
        return Verdict.ERROR, why, f"no answer to judge ({c.error_kind or 'http'}: {said})"
    if not c.ok:
        return Verdict.ERROR, "refused", f"HTTP {c.status} refused a {len(prompt)}-character prompt"
    if marker not in c.text:
        return Verdict.MISMATCH, "nonce_missing", f"HTTP {c.status}, but the model did not repeat the nonce"
    if prompt_tokens_dropped(sent, c.prompt_tokens):
        return (
            Verdict.MISMATCH,
            "prompt_tokens_mismatch",
            f"the engine reported {c.prompt_tokens} prompt tokens for {sent or 'a'} sent",
        )
    return Verdict.PASS, "nonce_intact", "the nonce came back intact"


def combine(checks: list[TenantCheck]) -> ProbeResult:
    """Return one result for all tenants: the worst verdict decides, every tenant is in evidence."""
    if not checks:
        return ProbeResult.error("no_tenants", "the target names no tenant to probe as")
    worst = max(checks, key=lambda c: _SEVERITY[c.verdict])
    measurements: dict[str, float] = {
        "tenants_checked": len(checks),
        "tenants_passed": sum(c.verdict is Verdict.PASS for c in checks),
    }
    for name in ("latency_seconds", "ttft_seconds"):
        values = [v for c in checks if (v := getattr(c.completion, name)) is not None]
        if values:
            measurements[name] = max(values)
    for name, value in (
        ("status_code", worst.completion.status),
        ("prompt_tokens_sent", worst.sent_tokens),
        ("prompt_tokens_reported", worst.completion.prompt_tokens),
    ):
        if value is not None:
            measurements[name] = value
    failing = [c for c in checks if c.verdict is worst.verdict]
    detail = "; ".join(f"{c.tenant}: {c.detail}" for c in failing)
    evidence = {"tenants": [c.evidence() for c in checks]}
    return ProbeResult(worst.verdict, worst.reason, detail, evidence, measurements)
