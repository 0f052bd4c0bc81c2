"""Full batch, mixed parameters: in a batch filled with every tenant's requests, each answer is its
own, and obeys its own parameters.

Targets batch rows whose outputs or per-request sampling parameters get crossed when a full batch's
rows differ and move (rows ending at staggered steps, rows recycled or compacted). A bleed of
parameters breaks no marker, so each answer is also judged against the parameters its own request
sent.

Each run sends ``size`` requests at once (the node's published ``max_running_requests``, else 32, at
most ``max_requests``), tenants in turn, each with its own fresh marker, new-token budget and stop
string, and by position sampled, penalised, ``n`` = 2, allowlisted or thinking-budgeted rows where the
engine takes them.

Verdicts: another tenant's marker is a ``leak``; another request's marker, a greedy answer without its
own marker, or an answer that breaks its own parameters (``stop_ignored``, ``token_not_allowed``,
``foreign_forced_string``, ``budget_exceeded``) is a ``mismatch``.

Rows, judging and cost in full, and the engine defects it targets: ``docs/detection.md``, "Probe
contracts in full".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeResult, Verdict, unjudgeable
from kvcanary.probes.canary import TenantCheck
from kvcanary.probes.markers import marker_hash
from kvcanary.probes.target import Completion, CompletionRequest
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
BUDGETS = (128, 144, 160, 176)
#: Characters between a row's stop string and the end of its budget: room for the answer to go on
#: past a stop it was not given.
STOP_BEFORE_BUDGET = 16
#: Tokens of thinking a thinking row is given past the end of its stop string.
THINKING_PAST_STOP = 12
#: Engines that take ``repetition_penalty`` and ``n`` beside OpenAI's fields.
PENALTY_ENGINES = ("vllm", "sglang", "reference")
N_ENGINES = ("vllm", "sglang")
#: Engines that take vLLM's ``thinking_token_budget``.
THINKING_ENGINES = ("vllm", "reference")
#: Engines whose tokens are the UTF-8 bytes of the text: an allowlist can be written and checked.
BYTE_TOKEN_ENGINES = ("reference",)
MARKER_ALPHABET = "KVC-0123456789abcdef"
FILLER = (
    "Filler to ignore: amber birch cedar dune ember fjord grove heath inlet juniper kestrel loam "
    "meadow nettle orchard pebble quarry rill sorrel thicket umber vale willow yarrow"
)


class FullBatchOptions(TriggerOptions):
    # Requests at once: None takes the node's published maximum of running requests, else 32.
    size: int | None = Field(None, ge=2, le=1024)
    max_requests: int = Field(64, ge=2, le=1024)
    # The target's reasoning-end string (vLLM's reasoning configuration): thinking rows are sent
    # and other rows judged for it only where it is stated.
    reasoning_end: str | None = Field(None, min_length=1, max_length=64)


class FullBatchProbe(Probe):
    """Fill a batch with every tenant's marked requests, parameters mixed; each must get its own
    answer, obeying its own parameters."""

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


@dataclass(frozen=True)
class Row:
    """What row ``index`` sends besides its marker, and what its answer must obey."""

    index: int
    #: ``CompletionRequest`` fields: budget, temperature, seed, stream, engine extras.
    fields: dict[str, Any]
    #: Greedy and unpenalised: its own marker is judged where due.
    greedy: bool
    stop: str
    #: Where its prompt holds its stop string.
    stop_at: int
    allowed: frozenset[int] | None = None
    thinking: int | None = None
    #: The reasoning-end string judged in the rows that set no thinking budget (None: not judged).
    reasoning_end: str | None = field(default=None)

    def prompt(self, marker: str) -> str:
        """Return the row's prompt: the question, then a filler tail holding its stop string."""
        head = QUESTION_TEMPLATE.format(marker=marker) + "\n"
        before = self.stop_at - len(head)
        tail = FILLER[:before] + self.stop + FILLER[before:]
        return head + tail[: max(0, int(self.fields["max_tokens"]) + 8 - len(head))]

    def violation(self, c: Completion, sent: str) -> tuple[str, str] | None:
        """Return (reason, detail) when the answer breaks this row's own parameters, else None."""
        text, label = c.text, f"row {self.index}"
        if (at := text.find(self.stop)) >= 0:
            return "stop_ignored", f"{label} asked to stop at {self.stop!r}; its answer holds it at {at}"
        if self.allowed is not None:
            bad = next(((i, b) for i, b in enumerate(text.encode()) if b not in self.allowed), None)
            if bad is not None:
                return "token_not_allowed", (
                    f"{label} allowed {len(self.allowed)} tokens (the marker's alphabet and its stop's); "
                    f"its answer holds token {bad[1]} ({chr(bad[1])!r}) at byte {bad[0]}"
                )
        end = self.reasoning_end
        if end and self.thinking is None and end in text and end not in sent:
            return "foreign_forced_string", (
                f"{label} set no thinking budget; its answer holds the reasoning-end string {end!r} "
                f"at character {text.find(end)}, which only another request's budget forces"
            )
        most = int(self.fields["max_tokens"]) * int(self.fields["extra"].get("n", 1))
        if c.completion_tokens is not None and c.completion_tokens > most:
            return "budget_exceeded", (
                f"{label} asked for at most {most} tokens; the engine reported {c.completion_tokens}"
            )
        return None


def row_parameters(i: int, engine: str, stream: bool, reasoning_end: str | None = None) -> Row:
    """Return row ``i``'s parameters (module docstring) on a target of ``engine``."""
    budget = BUDGETS[i // 2 % len(BUDGETS)]
    stop = f"<stop-{i:03d}>"
    fields: dict[str, Any] = {"max_tokens": budget, "temperature": 0.0, "stream": stream}
    extra: dict[str, Any] = {"stop": [stop]}
    if i % 2:
        fields.update(temperature=0.7, seed=i)
    if i % 3 == 2 and engine in PENALTY_ENGINES:
        extra["repetition_penalty"] = 1.1
    if i % 5 == 4 and engine in N_ENGINES:
        extra["n"] = 2
        fields["stream"] = False  # the choices of a stream interleave; a body keeps them apart
        fields.update(temperature=0.7, seed=i)  # vLLM refuses n > 1 with greedy sampling
    allowed = thinking = None
    stop_at = budget - STOP_BEFORE_BUDGET
    if i % 4 == 1 and engine in BYTE_TOKEN_ENGINES:
        allowed = frozenset((MARKER_ALPHABET + stop).encode())
        extra["allowed_token_ids"] = sorted(allowed)
    judged_end = reasoning_end if engine in THINKING_ENGINES else None
    if i % 4 == 2 and judged_end:
        thinking = stop_at + len(stop) + THINKING_PAST_STOP
        extra["thinking_token_budget"] = thinking
    fields["extra"] = extra
    greedy = fields["temperature"] == 0.0 and "repetition_penalty" not in extra
    return Row(i, fields, greedy, stop, stop_at, allowed, thinking, judged_end)


async def _row(ctx: ProbeContext, i: int, repeats: bool | None) -> TenantCheck:
    tenant = ctx.tenants[i % len(ctx.tenants)]
    marker_id, marker = ctx.markers.plant(ctx.target.name, tenant)
    stream = bool(ctx.options.get("stream", True))
    row = row_parameters(i, ctx.target.engine, stream, ctx.options.get("reasoning_end"))
    prompt = row.prompt(marker)
    request = CompletionRequest(prompt=prompt, chat=bool(ctx.options.get("chat", True)), **row.fields)
    c = await ctx.complete(tenant, request)
    # A sampled or penalised answer may change a faithful copy: only other markers count there.
    verdict, reason, detail = judge_own(c, request, marker, repeats if row.greedy else False, ctx.markers)
    judgeable = c.ok and unjudgeable(c) is None
    if reason != "other_request_marker" and judgeable and (broken := row.violation(c, prompt)) is not None:
        verdict, (reason, detail) = Verdict.MISMATCH, broken
    check = TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail)
    return step_check(check, f"row {i}")
