"""The replay and needle probes against a real vLLM server (CPU build, tiny random-weight model).

What a random-weight model makes each probe say:

- ``replay`` baselines (its greedy outputs agree over three sequential runs) and then passes every
  concurrent run with no false alarm. The probe needs no instruction following, so this is its real
  target: junk text is still the model's own, repeatable junk. Measured on vLLM's CPU build with
  float32: 0 deviations in every run here (4 prompts x 2 repeats, two in flight).
- ``needle`` is a ``mismatch`` with reason ``needle_lost``, on purpose: a random model cannot find and
  repeat a code. The test is kept rather than skipped because everything before the judgment is
  real and checked: the prompt is sized with vLLM's ``/tokenize`` to just under ``max_model_len``
  minus the headroom, vLLM accepts it (200: no refusal of an in-capacity prompt, so the headroom
  covers the chat template and ``max_tokens``, which vLLM counts against the window), and the usage
  reports at least the tokens sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.needle import MAX_TOKENS, TEMPLATE_HEADROOM, NeedleProbe, tolerance
from kvcanary.probes.replay import ReplayProbe
from tests.support.vllm import VllmServer

pytestmark = pytest.mark.vllm

RUNS = 6  # a baseline, then five concurrent replays
TENANTS = ("tenant-a", "tenant-b")


def target(server: VllmServer) -> OpenAIHttpTarget:
    config = TargetConfig(
        name="vllm-cpu",
        base_url=server.url,
        engine="vllm",
        model=server.model_name,
        tenants=[{"name": t} for t in TENANTS],
        timeout_seconds=60,
        probes=["canary"],
    )
    return OpenAIHttpTarget(config, dict.fromkeys(TENANTS))


async def replay(server: VllmServer, runs: int, **options: Any) -> list[ProbeResult]:
    """Run the replay ``runs`` times, each run given the state the last one kept (as the runner does)."""
    state: dict[str, Any] = {}
    results = []
    async with target(server) as client:
        for _ in range(runs):
            result = await ReplayProbe().run(ProbeContext(client, MarkerBook(), options, state=state))
            state = result.state if result.state is not None else state
            results.append(result)
    return results


@pytest.fixture(scope="module")
def replays(vllm_server: VllmServer) -> Iterator[list[ProbeResult]]:
    yield asyncio.run(replay(vllm_server, RUNS))


def test_replay_baselines_sequentially_then_passes_every_concurrent_run(replays: list[ProbeResult]) -> None:
    baseline, *later = replays
    assert (baseline.verdict, baseline.reason) == (Verdict.PASS, "baseline_recorded"), baseline.detail
    assert baseline.measurements["baseline_agreement"] == 1.0
    assert [(r.verdict, r.reason) for r in later] == [(Verdict.PASS, "replay_consistent")] * (RUNS - 1), [
        r.detail for r in later
    ]
    assert all(r.measurements["comparisons"] == 8 and r.measurements["failed_requests"] == 0 for r in later)


def test_the_tiny_model_is_deterministic_on_the_cpu_even_two_in_flight(replays: list[ProbeResult]) -> None:
    last = replays[-1]
    assert sum(r.measurements["deviations"] for r in replays[1:]) == 0, [r.evidence for r in replays]
    assert last.state is not None and last.state["comparisons"] == 8 + 8 * (RUNS - 1)
    # Junk, but the model's own: 32 tokens of it per prompt, kept bounded in the state.
    assert all(0 < len(e["output"]) <= 200 for e in last.state["baseline"])


def test_a_replay_with_four_in_flight_passes_too(vllm_server: VllmServer) -> None:
    results = asyncio.run(replay(vllm_server, 3, concurrency=4, repeats=4, prompts=6))
    assert [r.reason for r in results] == ["baseline_recorded", "replay_consistent", "replay_consistent"], [
        r.detail for r in results
    ]


def test_the_needle_is_sized_just_under_the_window_accepted_and_lost_by_a_random_model(
    vllm_server: VllmServer,
) -> None:
    async def go() -> ProbeResult:
        async with target(vllm_server) as client:
            return await NeedleProbe().run(ProbeContext(client, MarkerBook(), {}))

    result = asyncio.run(go())
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "needle_lost"), result.detail
    m = result.measurements
    goal = vllm_server.max_model_len - MAX_TOKENS - TEMPLATE_HEADROOM
    assert (m["status_code"], m["admission_limit"], m["prompt_tokens_target"]) == (
        200,
        vllm_server.max_model_len,
        goal,
    )
    assert goal - tolerance(goal) <= m["prompt_tokens_sent"] <= goal
    assert result.evidence["token_count"] == "tokenizer"
    # The chat template only adds tokens: no sign of a dropped prompt.
    assert m["prompt_tokens_sent"] <= m["prompt_tokens_reported"] <= vllm_server.max_model_len - MAX_TOKENS
