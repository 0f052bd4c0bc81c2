"""Session revisited: a conversation that comes back after other traffic carries only its own markers.

Targets a tier that keeps finished conversations' K/V and restores the wrong one when they return
(a host-memory session cache, an offload tier paged to disk or host).

Each run opens one conversation per tenant, a fresh marker in its first turn; then makes traffic the
conversations must survive: a canary per tenant, a churn burst sized from the node's KV pool, and a
plant (every tenant's own long conversation, each turn opening with a fresh marker, so that any
context a wrong restore hands back carries one); then continues every conversation at once, the
whole history sent back, asking for the code.

Verdicts: another tenant's marker in any answer, or another request's marker of the same tenant in a
continued conversation (``restored_foreign_conversation``), is a ``leak``; a continued answer without
its own marker is a ``mismatch`` where the model repeats.

Phases and options, judging and cost in full, and the defects it targets: ``docs/detection.md``,
"Probe contracts in full".
"""

from __future__ import annotations

import asyncio
import math
from typing import NamedTuple

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeResult, Verdict
from kvcanary.probes.canary import TenantCheck
from kvcanary.probes.markers import marker_hash
from kvcanary.probes.prefix_cache.prompts import fresh_text
from kvcanary.probes.target import CompletionRequest, ServerCapacity
from kvcanary.probes.triggers import (
    QUESTION_TEMPLATE,
    TriggerOptions,
    canary_check,
    conclude,
    judge_own,
    model_repeats,
    sizing_capacity,
    step_check,
)

FIRST_TURN = "Remember this code for later: {marker}\nSay OK."
REVISIT = "What was the code I asked you to remember? Repeat it exactly, with nothing else."
#: Letters of noise after each burst prompt's marker (about 256 tokens: two per letter on byte tokenizers).
BURST_LETTERS = 128
BURST_TOKENS = 256
#: The model's first answer goes back in the history, as clients send it, cut to this many characters.
ANSWER_CHARS = 2_000
#: A plant turn: a note opening with a fresh tag and its marker (within a restore's first pages), then
#: noise. The tag keeps a conversation's opening its own: one that opened like an earlier run's
#: could itself be restored from that run (rightly or not) and carry its opening's K/V on.
PLANT_TURN = "{tag} note {turn}, code {marker}: {noise}\nSay OK."
#: New tokens of a plant turn, and of the plant's answers sent back in its history.
PLANT_ANSWER_TOKENS = 16


class Turn(NamedTuple):
    """A tenant's opened conversation: its marker and the history to send back."""

    marker_id: str
    marker: str
    history: tuple[tuple[str, str], ...]


class SessionOptions(TriggerOptions):
    # Prompt tokens of the churn burst: None sizes it from the node's KV pool; 0 sends none.
    churn_tokens: int | None = Field(None, ge=0, le=10_000_000)
    max_churn_tokens: int = Field(262_144, ge=0, le=10_000_000)
    # Burst requests in flight at once.
    concurrency: int = Field(4, ge=1, le=64)
    # Turns of each tenant's planted long conversation (0 plants none), and its last prompt's size
    # (at most half the node's limit).
    plant_turns: int = Field(4, ge=0, le=16)
    plant_chars: int = Field(2048, ge=256, le=1_000_000)


class SessionProbe(Probe):
    """Open a marked conversation per tenant, churn the cache, continue them all; each keeps its own."""

    kind = "session"
    verifies_suspicion = True
    options_model = SessionOptions
    default_interval_seconds = 3600.0
    budget_timeouts = 12.0

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        repeats = await model_repeats(ctx)
        capacity = await sizing_capacity(ctx)
        cap = capacity.admission_limit // 2 if capacity and capacity.admission_limit else None
        firsts = await asyncio.gather(*(_first_turn(ctx, t, repeats, cap) for t in ctx.tenants))
        checks = [check for check, _ in firsts]
        checks += [await canary_check(ctx, t, "other_traffic", repeats) for t in ctx.tenants]
        burst = await _churn(ctx, _churn_tokens(ctx, capacity))
        planted, plant = await _plant(ctx, repeats, cap)
        checks += planted
        checks += await asyncio.gather(
            *(_revisit(ctx, t, turn, repeats, cap) for (_, turn), t in zip(firsts, ctx.tenants, strict=True))
        )
        result = conclude(checks, repeats, ctx)
        result.evidence["churn"] = burst
        result.evidence["plant"] = plant
        return result


async def _first_turn(
    ctx: ProbeContext, tenant: str, repeats: bool | None, cap: int | None
) -> tuple[TenantCheck, Turn]:
    marker_id, marker = ctx.markers.plant(ctx.target.name, tenant)
    prompt = FIRST_TURN.format(marker=marker)
    request = _chat(ctx, prompt, cap=cap)
    c = await ctx.complete(tenant, request)
    # The first turn asks for "OK", not the code: only other requests' markers are judged here.
    verdict, reason, detail = judge_own(c, request, marker, repeats, ctx.markers, asked=False)
    check = TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail)
    turn = Turn(marker_id, marker, (("user", prompt), ("assistant", c.text[:ANSWER_CHARS] if c.ok else "OK")))
    return step_check(check, "first_turn"), turn


async def _revisit(
    ctx: ProbeContext, tenant: str, turn: Turn, repeats: bool | None, cap: int | None
) -> TenantCheck:
    """Continue ``tenant``'s conversation: its history back, and the question about its marker."""
    request = _chat(ctx, REVISIT, history=turn.history, cap=cap)
    c = await ctx.complete(tenant, request)
    verdict, reason, detail = judge_own(c, request, turn.marker, repeats, ctx.markers)
    if reason == "other_request_marker":
        # Only another conversation's K/V holds another request's marker: a restored foreign
        # context, whichever of its own tenant's end users that conversation was.
        verdict, reason = Verdict.LEAK, "restored_foreign_conversation"
        detail = f"{detail}: the conversation was continued from another conversation's context"
    check = TenantCheck(tenant, turn.marker_id, marker_hash(turn.marker), None, c, verdict, reason, detail)
    return step_check(check, "revisit")


def _chat(
    ctx: ProbeContext, prompt: str, history: tuple[tuple[str, str], ...] = (), *, cap: int | None
) -> CompletionRequest:
    # Room for an echoing model to answer with the whole conversation (a real one stops at the code),
    # within half the node's limit: the prompt takes the rest.
    budget = int(ctx.options.get("max_tokens", 96)) + sum(len(text) for _, text in history) + len(prompt)
    budget = min(budget, cap) if cap else budget
    return CompletionRequest(
        prompt=prompt, max_tokens=budget, chat=bool(ctx.options.get("chat", True)),
        stream=bool(ctx.options.get("stream", True)), temperature=0.0, seed=0, history=history,
    )  # fmt: skip


async def _plant(
    ctx: ProbeContext, repeats: bool | None, cap: int | None
) -> tuple[list[TenantCheck], dict[str, int]]:
    """Grow every tenant's own long marked conversation, one turn a tenant in turn; return its checks
    (on other requests' markers only) and what was planted."""
    turns = int(ctx.options.get("plant_turns", 4))
    chars = int(ctx.options.get("plant_chars", 2048))
    chars = min(chars, cap - PLANT_ANSWER_TOKENS) if cap else chars
    # Each turn adds its share of the last prompt: the note and the answer sent back after it.
    note = max(1, chars // max(1, turns) - PLANT_ANSWER_TOKENS - len(PLANT_TURN) - 45)
    histories: dict[str, tuple[tuple[str, str], ...]] = dict.fromkeys(ctx.tenants, ())
    tags = {tenant: fresh_text(4) for tenant in ctx.tenants}
    checks, longest = [], 0
    for turn in range(1, turns + 1):
        for tenant in ctx.tenants:
            marker_id, marker = ctx.markers.plant(ctx.target.name, tenant)
            noise = fresh_text(max(1, note // 2))
            prompt = PLANT_TURN.format(tag=tags[tenant], turn=turn, marker=marker, noise=noise)
            request = CompletionRequest(
                prompt=prompt, max_tokens=PLANT_ANSWER_TOKENS, chat=bool(ctx.options.get("chat", True)),
                stream=bool(ctx.options.get("stream", True)), temperature=0.0, seed=0,
                history=histories[tenant],
            )  # fmt: skip
            c = await ctx.complete(tenant, request)
            verdict, reason, detail = judge_own(c, request, marker, repeats, ctx.markers, asked=False)
            check = TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail)
            checks.append(step_check(check, f"plant {turn}"))
            reply = c.text[:ANSWER_CHARS] if c.ok else "OK"
            histories[tenant] = (*histories[tenant], ("user", prompt), ("assistant", reply))
            longest = max(longest, sum(len(text) for _, text in histories[tenant]))
    return checks, {"turns": turns, "requests": len(checks), "longest_chars": longest}


def _churn_tokens(ctx: ProbeContext, capacity: ServerCapacity | None) -> int:
    stated = ctx.options.get("churn_tokens")
    cap = int(ctx.options.get("max_churn_tokens", 262_144))
    if stated is not None:
        return min(int(stated), cap)
    return min((capacity.kv_pool_tokens if capacity else None) or 0, cap)


async def _churn(ctx: ProbeContext, tokens: int) -> dict[str, int]:
    """Send marker-carrying prompts of about BURST_TOKENS each, every tenant in turn, ``tokens`` in all."""
    count = math.ceil(tokens / BURST_TOKENS) if tokens > 0 else 0
    gate = asyncio.Semaphore(int(ctx.options.get("concurrency", 4)))

    async def one(i: int) -> bool:
        tenant = ctx.tenants[i % len(ctx.tenants)]
        _, marker = ctx.markers.plant(ctx.target.name, tenant)
        prompt = f"{QUESTION_TEMPLATE.format(marker=marker)}\n{fresh_text(BURST_LETTERS)}"
        request = CompletionRequest(prompt=prompt, max_tokens=1, chat=False, stream=False, temperature=0.0)
        async with gate:
            return (await ctx.complete(tenant, request)).ok

    answered = await asyncio.gather(*(one(i) for i in range(count)))
    return {"requests": count, "answered": sum(answered), "tokens_asked": tokens}
