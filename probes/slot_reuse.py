"""Slot reuse: a request that takes the batch slot another tenant's request just left gets only its own.

Targets: an engine that keeps per-slot state (tokens, sampling state) in its running batch and
hands a freed slot to the next request without clearing it while other requests keep the batch
busy: vLLM GHSA-v97p-wpxp-px84 (0.16.0 up to 0.21.0, with asynchronous scheduling and pipeline
parallelism: tokens a finished request left in its batch slot were fed into the next occupant's
request, its KV cache and its output), tabbyAPI#107 (a second user's request right after the
first's received the first user's generation), vllm#45357 (a step still in flight for a finished
request wrote into what the next one was handed).

Each run keeps the batch busy with ``busy`` long requests (tenants in turn, each a fresh marker and
then the code again on every line: an echoing model writes its whole budget, an instruction model
writes on until stopped, and vLLM and SGLang are told to ignore end-of-sequence), and while they
run, ``pairs`` times in a row: one tenant's canary-shaped request (its fresh marker, the canary's
question) is answered, and the moment its answer ends the next tenant's is sent. An engine hands a
freed slot to the next request that joins (vLLM's persistent batch reuses the index it freed; the
reference worker takes the most recently freed slot), so each request takes the slot its
predecessor just left, while the busy requests keep the batch from draining.

Judged as the canary (:mod:`probes.triggers`), which is sound whatever the engine's drift:
- the predecessor's marker, or any other tenant's, in an answer is a ``leak``: only that request's
  tokens, KV or answer hold it, never chance (a sealed 128-bit marker);
- another request's marker of the same tenant a ``mismatch`` (``other_request_marker``);
- a pair's answer without its own marker a ``mismatch`` where the model repeats: the canary's
  90-character prompt is written back before greedy answers can drift;
- the busy answers on foreign and other requests' markers only (long answers drift); a busy
  answer that cannot be judged (a timeout on a loaded engine) is kept in the evidence
  (``busy_unjudged``) and decides nothing: it only kept the pairs company, and what it did send was
  scanned for foreign markers all the same.
A pair sent after the busy requests ended is judged alike, but recreates nothing (the evidence
counts the pairs sent while the batch was busy: ``pairs_while_busy``).

Cost: ``busy`` requests of about ``busy_tokens`` prompt tokens (2,048 by default, at most half the
node's limit) writing as many, and ``2 * pairs`` canaries (at most 96 new tokens each): 9,662
tokens a run on the reference worker; default interval 1,800 s.
"""

from __future__ import annotations

import asyncio

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeResult, Verdict
from kvcanary.probes.canary import TenantCheck
from kvcanary.probes.hangup import abandoned_prompt
from kvcanary.probes.markers import marker_hash
from kvcanary.probes.target import CompletionRequest
from kvcanary.probes.triggers import (
    TriggerOptions,
    canary_check,
    conclude,
    judge_own,
    model_repeats,
    sizing_capacity,
    step_check,
)

#: Engines told to write the busy answers to their budget whatever their model says.
IGNORE_EOS_ENGINES = ("vllm", "sglang")


class SlotReuseOptions(TriggerOptions):
    # Requests keeping the batch busy while the pairs run.
    busy: int = Field(2, ge=1, le=16)
    # Prompt tokens of each busy request, and as many new ones (at most half the node's limit).
    busy_tokens: int = Field(2048, ge=64, le=65_536)
    # Requests sent one right after another, each into the slot its predecessor left.
    pairs: int = Field(4, ge=1, le=64)


class SlotReuseProbe(Probe):
    """Keep a batch busy; send each tenant's request the moment the previous tenant's ended; each
    answer must carry its own marker and no other."""

    kind = "slot_reuse"
    verifies_suspicion = True
    options_model = SlotReuseOptions
    default_interval_seconds = 1800.0
    budget_timeouts = 8.0

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        repeats = await model_repeats(ctx)
        tokens = await _busy_tokens(ctx)
        count = int(ctx.options.get("busy", 2))
        busy = [asyncio.ensure_future(_busy(ctx, i, tokens, repeats)) for i in range(count)]
        checks: list[TenantCheck] = []
        while_busy = 0
        try:
            for k in range(int(ctx.options.get("pairs", 4))):
                for half in ("first", "next"):
                    tenant = ctx.tenants[(2 * k + (half == "next")) % len(ctx.tenants)]
                    while_busy += half == "next" and not all(task.done() for task in busy)
                    checks.append(await canary_check(ctx, tenant, f"pair {k} {half}", repeats))
            busy_checks = await asyncio.gather(*busy)
        finally:
            for task in busy:  # a run cut short (its budget, a shutdown) leaves no request behind
                task.cancel()
        result = conclude([*checks, *busy_checks], repeats, ctx)
        result.evidence.update(pairs_while_busy=while_busy, busy_tokens=tokens)
        return result


async def _busy_tokens(ctx: ProbeContext) -> int:
    stated = int(ctx.options.get("busy_tokens", 2048))
    capacity = await sizing_capacity(ctx)
    limit = capacity.admission_limit if capacity else None
    return min(stated, limit // 2) if limit else stated


async def _busy(ctx: ProbeContext, i: int, tokens: int, repeats: bool | None) -> TenantCheck:
    """One long answer keeping the batch busy, judged on other requests' markers only."""
    tenant = ctx.tenants[i % len(ctx.tenants)]
    marker_id, marker = ctx.markers.plant(ctx.target.name, tenant)
    extra = {"ignore_eos": True} if ctx.target.engine in IGNORE_EOS_ENGINES else {}
    request = CompletionRequest(
        prompt=abandoned_prompt(marker, tokens), max_tokens=tokens, chat=bool(ctx.options.get("chat", True)),
        stream=bool(ctx.options.get("stream", True)), temperature=0.0, seed=0, extra=extra,
    )  # fmt: skip
    c = await ctx.complete(tenant, request)
    verdict, reason, detail = judge_own(c, request, marker, repeats, ctx.markers, asked=False)
    if verdict is Verdict.ERROR:
        verdict, reason, detail = Verdict.PASS, "busy_unjudged", f"not judged ({reason}): {detail}"
    check = TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail)
    return step_check(check, f"busy {i}")
