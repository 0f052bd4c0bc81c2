"""Full batch, mixed parameters: in a batch filled with every tenant's requests, each answer is its own.

Targets: batch rows whose sampling parameters or outputs get crossed when a batch is full and its
rows differ: vllm#5607 (a greedy request's output depended on a concurrent one with
``repetition_penalty``), vllm#14645 (batch order inferred from dict keys: tokens "leaked" from
other requests with mixed speculative lengths), vllm#39146 (11 of 21 concurrent mixed requests
diverged), mlx-lm#965 (answers to other concurrent prompts at 16 requests, 15 of 20 runs),
sglang#4593, tabbyAPI#107.

Each run sends ``size`` requests at once: the node's published maximum of running requests
(SGLang's and the reference worker's ``max_running_requests``), else 32, at most
``max_requests``; tenants in turn, each request with its own fresh marker and the canary's
question, and its parameters varied by position: the new-token budget (96, 128, 160, 192), every
second one sampled (temperature 0.7 with a seed), every third with ``repetition_penalty`` 1.1
where the engine takes it (vLLM, SGLang, the reference worker), every fourth with a stop string
that cannot occur in the answer, and every fifth with ``n`` = 2, sampled and not streamed where
the engine takes it (vLLM, SGLang; every choice is scanned; vLLM refuses ``n`` > 1 when greedy).
Judged as the canary (:mod:`probes.triggers`): another tenant's marker anywhere is a
``leak``, another request's marker a ``mismatch``; a greedy answer without its own marker is a
``mismatch`` where the model repeats (the marker ends within the first 65 characters sent, before
greedy answers can drift), while sampled and penalised answers are judged on other markers only (a
penalty or a temperature may change a faithful copy).

Cost: ``size`` requests (32 by default) of about 40 prompt tokens and at most 192 new ones each,
plus the lone canary every 10 minutes; default interval 1,800 s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeResult
from kvcanary.probes.canary import TenantCheck
from kvcanary.probes.markers import marker_hash
from kvcanary.probes.target import CompletionRequest
from kvcanary.probes.triggers import (
    QUESTION_TEMPLATE,
    TriggerOptions,
    conclude,
    judge_own,
    model_repeats,
    sizing_capacity,
    step_check,
)

DEFAULT_SIZE = 32
BUDGETS = (96, 128, 160, 192)
#: Engines that take ``repetition_penalty`` and ``n`` beside OpenAI's fields.
PENALTY_ENGINES = ("vllm", "sglang", "reference")
N_ENGINES = ("vllm", "sglang")
STOP = "\n\n\n\n"


class FullBatchOptions(TriggerOptions):
    # Requests at once: None takes the node's published maximum of running requests, else 32.
    size: int | None = Field(None, ge=2, le=1024)
    max_requests: int = Field(64, ge=2, le=1024)


class FullBatchProbe(Probe):
    """Fill a batch with every tenant's marked requests, parameters mixed; each must get its own."""

    kind = "full_batch"
    verifies_suspicion = True
    options_model = FullBatchOptions
    default_interval_seconds = 1800.0

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        repeats = await model_repeats(ctx)
        size = await _size(ctx)
        checks = await asyncio.gather(*(_row(ctx, i, repeats) for i in range(size)))
        result = conclude(list(checks), repeats, ctx)
        result.evidence["batch_size"] = size
        return result


async def _size(ctx: ProbeContext) -> int:
    stated = ctx.options.get("size")
    if stated is None:
        capacity = await sizing_capacity(ctx)
        stated = (capacity.max_running_requests if capacity else None) or DEFAULT_SIZE
    return min(int(stated), int(ctx.options.get("max_requests", 64)))


def row_parameters(i: int, engine: str, stream: bool) -> tuple[dict[str, Any], bool]:
    """Return the varied fields of row ``i`` (temperature, extras, stream) and whether it is greedy."""
    # Budgets change every second row, so that neither tenant (rows alternate) owns a budget.
    budget = BUDGETS[i // 2 % len(BUDGETS)]
    fields: dict[str, Any] = {"max_tokens": budget, "temperature": 0.0, "stream": stream}
    extra: dict[str, Any] = {}
    if i % 2:
        fields.update(temperature=0.7, seed=i)
    if i % 3 == 2 and engine in PENALTY_ENGINES:
        extra["repetition_penalty"] = 1.1
    if i % 4 == 3:
        extra["stop"] = [STOP]
    if i % 5 == 4 and engine in N_ENGINES:
        extra["n"] = 2
        fields["stream"] = False  # the choices of a stream interleave; a body keeps them apart
        fields.update(temperature=0.7, seed=i)  # vLLM refuses n > 1 with greedy sampling
    fields["extra"] = extra
    greedy = fields["temperature"] == 0.0 and "repetition_penalty" not in extra
    return fields, greedy


async def _row(ctx: ProbeContext, i: int, repeats: bool | None) -> TenantCheck:
    tenant = ctx.tenants[i % len(ctx.tenants)]
    marker_id, marker = ctx.markers.plant(ctx.target.name, tenant)
    prompt = QUESTION_TEMPLATE.format(marker=marker)
    fields, greedy = row_parameters(i, ctx.target.engine, bool(ctx.options.get("stream", True)))
    request = CompletionRequest(prompt=prompt, chat=bool(ctx.options.get("chat", True)), **fields)
    c = await ctx.complete(tenant, request)
    # A sampled or penalised answer may change a faithful copy: only other markers count there.
    verdict, reason, detail = judge_own(c, request, marker, repeats if greedy else False, ctx.markers)
    check = TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail)
    return step_check(check, f"row {i}")
