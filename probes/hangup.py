"""Client hang-up: after a tenant abandons a request mid-answer, every next answer is its own.

Targets: an engine or a gateway that does not stop what a client abandoned, or stops it but hands
on what it was still writing: the 2023 ChatGPT incident (redis-py#2624, #2665: a request cancelled
after it was sent left its reply on a pooled connection, and the next, unrelated user read it: other
users' chat titles and payment details), vllm#45357 (a step still in flight for a finished or
preempted request wrote into blocks already handed to the next one), sglang#23392 and vllm#39146
(cancel and retry: the retry diverged or replayed a stale answer).

Each run hangs up three times, each time as the next tenant in turn, on a request whose answer
carries that tenant's fresh marker (it comes before the question, so the rest of an echoing
model's answer carries it too) and goes on for long (the code again on every line):
1. ``mid_stream``: a streamed request, closed after its first ``chunks_before_hang_up`` chunks;
2. ``before_body``: a streamed request, closed as soon as the response's headers came;
3. ``client_timeout``: a non-streamed request whose client gives up after
   ``client_timeout_seconds`` (0.02 s: before most answers are done).
Right after each hang-up (where the engine counts aborts, once it counted this one: at most
``ABORT_SEEN_SECONDS``) every other tenant sends a canary at once (:mod:`probes.canary`), and the
tenant that hung up sends one once theirs are answered: what an engine hands on goes to whoever it
admits next, and that is then another tenant, however slow the machine. Judged as the canary
(:mod:`probes.triggers`): the abandoned marker, or any other tenant's, in an answer is a ``leak``;
a canary that lost its own nonce (for instance to the rest of its own tenant's abandoned answer) a
``mismatch`` where the model repeats (the canary's 90-character prompt: due before greedy answers
can drift). The abandoned answers are scanned for foreign markers as well, never judged for their
own.

Where the engine counts aborted requests (the reference worker's ``kvcanary_requests_aborted_total``,
SGLang's ``sglang:num_aborted_requests_total``), the count on the target's nodes must move after
the run hung up on an unfinished answer: an engine that never saw the client go is still spending
tokens on it (``abort_not_counted``, a ``mismatch``). llama.cpp exports no such counter, and vLLM's
abort series does not count client hang-ups (``probes.engine_counters.ABORT_COUNTERS``): not
judged there (``aborts_counted`` is None).

Cost: 3 abandoned requests (prompts of ``abandoned_max_tokens`` characters, 512 by default: about 150
tokens each on a real tokenizer; the engine stops each answer after a few tokens, at most
``abandoned_max_tokens`` where it does not) and ``3 T`` canaries (at most 96 new tokens each), plus the lone
canary every 10 minutes and a metric scrape per node before and after the run, before each hang-up,
and every 50 ms while a real hang-up is not counted yet (at most 2 s each); default interval 600 s.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeResult, Verdict
from kvcanary.probes.canary import TenantCheck
from kvcanary.probes.engine_counters import aborted_requests
from kvcanary.probes.target import Completion, CompletionRequest
from kvcanary.probes.triggers import TriggerOptions, canary_check, conclude, model_repeats, sizing_capacity

#: A long answer, so that it is still being written when the probe hangs up: the prompt asks for
#: the code on line after line and shows it so (``abandoned_prompt``).
ABANDONED_HEAD = (
    "Remember this code: {marker}\nRepeat the code exactly, then again once per line until stopped:\n"
)
#: How long the probe waits for the engine to count a hang-up before its canaries go anyway: an
#: engine notices a client gone at its next write or disconnect poll (the reference worker: 10 ms).
ABORT_SEEN_SECONDS = 2.0
ABORT_POLL_SECONDS = 0.05
#: How long a run that hung up waits at its end for an abort count that has not moved at all before
#: it judges ``abort_not_counted``: a loaded engine notices late (a benign worker beside a second
#: test suite on 2 cores had counted none by the end of its run). Spent only where nothing moved.
ABORT_LATE_SECONDS = 15.0
#: What the late wait leaves of the run's budget for the last read and the verdict: a target with a
#: short timeout gets a shorter wait, and a judged ``abort_not_counted`` rather than a cut run.
ABORT_LATE_MARGIN_SECONDS = 1.0


@dataclass(frozen=True)
class HangUp:
    """One way a client goes away."""

    step: str
    stream: bool
    after_chunks: int | None = None
    after_seconds: float | None = None


class HangupOptions(TriggerOptions):
    # New tokens the abandoned request asks for: it must still be running when the probe hangs up.
    abandoned_max_tokens: int = Field(512, ge=16, le=32768)
    # Stream chunks read before hanging up mid-stream (a chat stream's first chunk is its role).
    chunks_before_hang_up: int = Field(3, ge=1, le=64)
    # How long the non-streamed client waits before it gives up: shorter than most answers take.
    client_timeout_seconds: float = Field(0.02, gt=0, le=60)


class HangupProbe(Probe):
    """Hang up on a tenant's marker-carrying answer three ways; every next answer must be its own."""

    kind = "hangup"
    verifies_suspicion = True
    options_model = HangupOptions
    default_interval_seconds = 600.0
    # Three hang-ups, each followed by two rounds of canaries and up to ABORT_SEEN_SECONDS of
    # waiting for the engine to count it, the lone canary and the sizing reads.
    budget_timeouts = 11.0

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        repeats = await model_repeats(ctx)
        before = await _aborts(ctx)
        capacity = await sizing_capacity(ctx)
        limit = capacity.admission_limit if capacity else None
        max_tokens = int(ctx.options.get("abandoned_max_tokens", 512))
        max_tokens = min(max_tokens, limit // 3) if limit else max_tokens  # the prompt is as long
        checks: list[TenantCheck] = []
        abandoned: list[dict[str, Any]] = []
        for i, hang_up in enumerate(_hang_ups(ctx.options)):
            tenant = ctx.tenants[i % len(ctx.tenants)]
            counted = await _aborts(ctx) if before is not None else None
            c = await _abandon(ctx, tenant, hang_up, max_tokens)
            # A hang-up counts when the answer was not over by then (no finish came before it).
            hung_up = c.error_kind == "hung_up" and c.finish_reason is None
            seen = await _abort_seen(ctx, counted) if hung_up and counted is not None else None
            abandoned.append({"step": hang_up.step, "tenant": tenant, "hung_up": hung_up,
                              "chars_read": len(c.text), "status_code": c.status,
                              "abort_seen_seconds": seen})  # fmt: skip
            checks += await _followers(ctx, tenant, hang_up.step, repeats)
        hung_up_on = sum(a["hung_up"] for a in abandoned)
        after = await _aborts_at_end(ctx, before, hung_up_on)
        result = conclude(checks, repeats, ctx)
        result.evidence["abandoned"] = abandoned
        return _judge_aborts(result, before, after, hung_up_on)


def _hang_ups(options: dict[str, Any]) -> tuple[HangUp, ...]:
    return (
        HangUp("mid_stream", stream=True, after_chunks=int(options.get("chunks_before_hang_up", 3))),
        HangUp("before_body", stream=True, after_chunks=0),
        HangUp(
            "client_timeout", stream=False, after_seconds=float(options.get("client_timeout_seconds", 0.02))
        ),
    )


async def _abandon(ctx: ProbeContext, tenant: str, hang_up: HangUp, max_tokens: int) -> Completion:
    """Send ``tenant`` a request whose answer carries its fresh marker, and hang up on it."""
    _, marker = ctx.markers.plant(ctx.target.name, tenant)
    request = CompletionRequest(
        prompt=abandoned_prompt(marker, max_tokens),
        max_tokens=max_tokens,
        chat=bool(ctx.options.get("chat", True)),
        stream=hang_up.stream,
        temperature=0.0,
        seed=0,
        hang_up_after_chunks=hang_up.after_chunks,
        hang_up_after_seconds=hang_up.after_seconds,
    )
    return await ctx.complete(tenant, request)


def abandoned_prompt(marker: str, max_tokens: int) -> str:
    """The abandoned request's prompt: the head, then ``marker`` line after line, at least
    ``max_tokens`` characters in all (no tokenizer has fewer characters than tokens).

    A model that follows it writes on until stopped; one that echoes or continues the pattern (the
    reference worker's copy model, a base model) writes its whole budget. An answer that ends
    sooner can be over before the engine sees its client go, and a healthy engine then counts no
    abort (the copy model echoed the one-line prompt in 91 tokens, 50 ms).
    """
    head = ABANDONED_HEAD.format(marker=marker)
    line = f"{marker}\n"
    return head + line * max(1, -(-(max_tokens - len(head)) // len(line)))


async def _followers(ctx: ProbeContext, abandoner: str, step: str, repeats: bool | None) -> list[TenantCheck]:
    """Every tenant's canary right after a hang-up: the others at once, the one that hung up once
    they are answered (what an engine hands on goes to whoever comes next: best another tenant)."""
    others = [canary_check(ctx, t, step, repeats) for t in ctx.tenants if t != abandoner]
    checks = list(await asyncio.gather(*others))
    return [*checks, await canary_check(ctx, abandoner, step, repeats)]


async def _abort_seen(ctx: ProbeContext, before: float) -> float | None:
    """Wait until the engine's abort count rises above ``before``, its count just before this
    hang-up (at most ``ABORT_SEEN_SECONDS``); return the seconds that took, or None when it did not
    (a count below ``before``, a restart or a node not read, ends the wait too)."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    while loop.time() < began + ABORT_SEEN_SECONDS:
        now = await _aborts(ctx)
        if now is None or now < before:
            return None
        if now > before:
            return round(loop.time() - began, 3)
        await asyncio.sleep(ABORT_POLL_SECONDS)
    return None


async def _aborts_at_end(ctx: ProbeContext, before: float | None, hung_up: int) -> float | None:
    """Return the abort count at the run's end; where the run hung up and the count has not moved,
    wait for it up to ``ABORT_LATE_SECONDS`` first, and never past the run's own budget."""
    after = await _aborts(ctx)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ABORT_LATE_SECONDS
    if ctx.deadline is not None:
        deadline = min(deadline, ctx.deadline - ABORT_LATE_MARGIN_SECONDS)
    while hung_up and before is not None and after == before and loop.time() < deadline:
        await asyncio.sleep(ABORT_POLL_SECONDS * 5)
        after = await _aborts(ctx)
    return after


async def _aborts(ctx: ProbeContext) -> float | None:
    """Return the aborted requests the target's nodes count in all, or None where none counts them."""
    counts = []
    for node in ctx.target.nodes:
        scraped = await ctx.target.scrape(node.metrics_url)
        if scraped.samples is not None:
            counts.append(aborted_requests(ctx.target.engine, scraped.samples))
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def _judge_aborts(
    result: ProbeResult, before: float | None, after: float | None, hung_up: int
) -> ProbeResult:
    """Add the abort count to ``result``; a count that stood still after a real hang-up is a mismatch."""
    if before is None or after is None:
        result.evidence["aborts_counted"] = None  # not exported here: not judged
        return result
    moved = after - before if after >= before else after  # a drop is a restart
    result.evidence["aborts_counted"] = moved
    if hung_up and moved < 1 and result.verdict in (Verdict.PASS, Verdict.ERROR):
        result.verdict, result.reason = Verdict.MISMATCH, "abort_not_counted"
        result.detail = (
            f"the probe hung up on {hung_up} unfinished answer(s) and the engine's abort count did not "
            "move: it did not see its clients go, and may still be writing their answers"
        )
    return result
