"""The replay, needle and canary probes against a real llama-cpp-python server (tiny random model).

llama-cpp-python's server (see README.md here) states no context size (no ``/props``), counts
tokens only at ``/extras/tokenize/count`` (the target's client asks there for engine ``llamacpp``),
serves one request at a time, cuts a running stream when another request arrives, and sends no
usage in streams. What each probe makes of that:

- ``replay`` does not stream, so every answer is whole and carries usage, and its concurrent
  requests queue behind the server's lock instead of cutting each other. It baselines and then
  passes run after run: measured 0 deviations (greedy output here is bit-for-bit repeatable).
- ``needle`` needs the context size, which the operator states in the target's config
  (``options.boundary.context_window``, the same override the boundary probe reads). It is sized
  with ``/extras/tokenize/count``, accepted (200) and, the model being random, ``needle_lost``.
- ``canary`` streams: it sees no ``usage.prompt_tokens`` here, so its prompt-token invariant cannot
  be checked on this engine (``prompt_tokens_reported`` is absent) and only the nonce is judged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.needle import MAX_TOKENS, TEMPLATE_HEADROOM, NeedleProbe, tolerance
from kvcanary.probes.replay import ReplayProbe
from tests.support.llamacpp import LlamaCppServer

pytestmark = pytest.mark.llamacpp

TENANTS = ("tenant-a", "tenant-b")
RUNS = 11  # a baseline, then ten concurrent replays
N_CTX = 2048  # a multiple of 256 (llama.cpp pads the context), room for a needle worth the name


def target(server: LlamaCppServer, **stated: int) -> OpenAIHttpTarget:
    config = TargetConfig(
        name="llamacpp-cpu",
        base_url=server.url,
        engine="llamacpp",
        model=server.model_name,
        tenants=[{"name": t} for t in TENANTS],
        timeout_seconds=60,
        probes=["canary"],
        options={"boundary": stated} if stated else {},
    )
    return OpenAIHttpTarget(config, dict.fromkeys(TENANTS))


async def replay(client: OpenAIHttpTarget, runs: int, **options: Any) -> list[ProbeResult]:
    """Run the replay ``runs`` times, each run given the state the last one kept (as the runner does)."""
    state: dict[str, Any] = {}
    results = []
    for _ in range(runs):
        result = await ReplayProbe().run(ProbeContext(client, MarkerBook(), options, state=state))
        state = result.state if result.state is not None else state
        results.append(result)
    return results


def run_replay(server: LlamaCppServer, runs: int, **options: Any) -> list[ProbeResult]:
    async def go() -> list[ProbeResult]:
        async with target(server) as client:
            return await replay(client, runs, **options)

    return asyncio.run(go())


def test_replay_baselines_then_passes_repeated_concurrent_runs_without_a_false_alarm(
    llamacpp_server: LlamaCppServer,
) -> None:
    baseline, *later = run_replay(llamacpp_server, RUNS)
    assert (baseline.verdict, baseline.reason) == (Verdict.PASS, "baseline_recorded"), baseline.detail
    assert [(r.verdict, r.reason) for r in later] == [(Verdict.PASS, "replay_consistent")] * (RUNS - 1), [
        r.detail for r in later
    ]
    assert sum(r.measurements["deviations"] for r in later) == 0
    assert all(r.measurements["failed_requests"] == 0 for r in later)
    # The longest default prompt and 32 new tokens fit the shared server's 256-token context.
    assert llamacpp_server.n_ctx == 256


def test_replay_passes_with_four_in_flight_and_every_prompt(
    llamacpp_servers: Callable[..., LlamaCppServer],
) -> None:
    results = run_replay(llamacpp_servers(n_ctx=N_CTX), 3, concurrency=4, repeats=4, prompts=6)
    assert [r.reason for r in results] == ["baseline_recorded", "replay_consistent", "replay_consistent"], [
        r.detail for r in results
    ]


def test_replay_answers_carry_usage_because_they_are_not_streamed(llamacpp_server: LlamaCppServer) -> None:
    async def go() -> dict[str, int]:
        async with target(llamacpp_server) as client:
            ctx = ProbeContext(client, MarkerBook(), {"rebaseline": True})
            await ReplayProbe().run(ctx)
            return ctx.tokens

    tokens = asyncio.run(go())
    assert tokens["prompt"] > 0 and tokens["completion"] == 12 * 32  # 4 prompts x 3 runs x 32 tokens


def test_the_needle_needs_the_context_size_stated_in_the_config(llamacpp_server: LlamaCppServer) -> None:
    async def go() -> ProbeResult:
        async with target(llamacpp_server) as client:
            return await NeedleProbe().run(ProbeContext(client, MarkerBook(), {}))

    result = asyncio.run(go())
    assert (result.verdict, result.reason) == (Verdict.ERROR, "capacity_unknown")


def test_the_needle_is_counted_by_the_extras_tokenizer_accepted_and_lost_by_a_random_model(
    llamacpp_servers: Callable[..., LlamaCppServer],
) -> None:
    async def go() -> ProbeResult:
        async with target(llamacpp_servers(n_ctx=N_CTX), context_window=N_CTX) as client:
            return await NeedleProbe().run(ProbeContext(client, MarkerBook(), {}))

    result = asyncio.run(go())
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "needle_lost"), result.detail
    m = result.measurements
    goal = N_CTX - MAX_TOKENS - TEMPLATE_HEADROOM
    assert (m["status_code"], m["admission_limit"], m["prompt_tokens_target"]) == (200, N_CTX, goal)
    assert goal - tolerance(goal) <= m["prompt_tokens_sent"] <= goal
    assert result.evidence["token_count"] == "tokenizer"
    # Not streamed, so usage is there; the chat template adds a few tokens to the raw count.
    assert m["prompt_tokens_sent"] <= m["prompt_tokens_reported"] < N_CTX - MAX_TOKENS


def test_the_canary_streams_and_so_sees_no_prompt_tokens_on_this_engine(
    llamacpp_server: LlamaCppServer,
) -> None:
    async def go() -> ProbeResult:
        async with target(llamacpp_server) as client:
            return await REGISTRY["canary"]().run(ProbeContext(client, MarkerBook(), {}))

    result = asyncio.run(go())
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "nonce_missing"), result.detail
    assert "prompt_tokens_reported" not in result.measurements
    assert "prompt_tokens_sent" in result.measurements  # counted at /extras/tokenize/count
    assert all(t["prompt_tokens_reported"] is None for t in result.evidence["tenants"])
