"""The replay probe: its statistics, a scripted engine at the seam, and the reference worker as a process."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from scipy.stats import binomtest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.markers import MARKER_RE, MarkerBook
from kvcanary.probes.replay import PROMPTS, ReplayProbe, binomial_tail, rate_under_test
from tests.probes.probe_harness import Call, FakeEngine, answer, error

DEFAULT_N = 8  # 4 prompts x 2 repeats
BASELINE_CALLS = 12  # 4 prompts x 3 runs


async def replay_runs(
    target: OpenAIHttpTarget,
    runs: int,
    state: dict[str, Any] | None = None,
    book: MarkerBook | None = None,
    **options: Any,
) -> tuple[list[ProbeResult], dict[str, Any]]:
    """Run the replay ``runs`` times as the runner would: judged, each run given the last state kept."""
    state = dict(state or {})
    results = []
    for _ in range(runs):
        ctx = ProbeContext(target, book if book is not None else MarkerBook(), options, state=state)
        result = await ReplayProbe().run(ctx)
        if result.state is not None:
            state = result.state
        results.append(result)
    return results, state


def run(engine: FakeEngine, runs: int = 1, state=None, **options) -> tuple[list[ProbeResult], dict[str, Any]]:
    async def go():
        async with engine.target() as target:
            return await replay_runs(target, runs, state, **options)

    return asyncio.run(go())


def garble(call: Call) -> httpx.Response:
    """Answer what a decode over someone else's KV would: not this prompt's continuation."""
    return answer(call, "stale page: " + call.prompt[::-1][: call.body["max_tokens"]])


# --- the statistics ---------------------------------------------------------------------------------------

# (d, n, p0) as the probe meets them: clean runs, a flip or two, full divergence, tiny and large rates.
TRIPLES = [
    (0, 8, 0.01), (1, 8, 0.01), (2, 8, 0.1), (4, 8, 0.01), (8, 8, 0.01), (8, 8, 0.1), (5, 8, 0.02),
    (3, 16, 0.05), (16, 16, 0.3), (1, 1, 1 / 3), (7, 96, 0.0123), (50, 128, 0.2), (128, 128, 0.01),
]  # fmt: skip


@pytest.mark.parametrize(("d", "n", "p0"), TRIPLES)
def test_the_binomial_tail_matches_scipys_exact_one_sided_test(d: int, n: int, p0: float) -> None:
    expected = binomtest(d, n, p0, alternative="greater").pvalue
    assert binomial_tail(d, n, p0) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_the_binomial_tail_handles_its_edges() -> None:
    assert binomial_tail(0, 8, 0.5) == 1.0 and binomial_tail(9, 8, 0.5) == 0.0
    assert binomial_tail(1, 8, 0.0) == 0.0 and binomial_tail(8, 8, 1.0) == 1.0
    assert 0.0 < binomial_tail(400, 400, 0.01) < 1e-700 or binomial_tail(400, 400, 0.01) == 0.0


def test_the_rate_tested_is_laplaces_estimate_with_a_floor() -> None:
    assert rate_under_test(0, 0, 0.01) == 0.5
    assert rate_under_test(8, 0, 0.01) == 0.1  # right after a baseline of 4 prompts x 3 runs
    assert rate_under_test(10_000, 0, 0.01) == 0.01
    assert rate_under_test(998, 99, 0.01) == 0.1


def test_the_false_alarm_rate_at_the_defaults_is_under_alpha_and_full_divergence_alarms() -> None:
    alpha, n, floor = 1e-6, DEFAULT_N, 0.01
    needed = next(d for d in range(n + 1) if binomial_tail(d, n, floor) < alpha)
    assert needed == 4  # half the outputs must deviate
    assert binomial_tail(needed, n, floor) == pytest.approx(6.78e-7, rel=1e-3)  # per run, at worst
    assert binomial_tail(n, n, rate_under_test(8, 0, floor)) < alpha  # the first run after a baseline


# --- judgment, with a scripted engine -------------------------------------------------------------------


def test_the_first_run_records_a_sequential_baseline_and_the_second_replays_concurrently() -> None:
    engine = FakeEngine(hold_seconds=0.25)  # neighbours sent together overlap, however loaded the machine
    (first, second), state = run(engine, 2)
    assert (first.verdict, first.reason) == (Verdict.PASS, "baseline_recorded"), first.detail
    assert first.measurements["baseline_agreement"] == 1.0
    assert (second.verdict, second.reason) == (Verdict.PASS, "replay_consistent"), second.detail
    assert (second.measurements["comparisons"], second.measurements["deviations"]) == (DEFAULT_N, 0)
    baseline, replay = engine.calls[:BASELINE_CALLS], engine.calls[BASELINE_CALLS:]
    assert len(replay) == DEFAULT_N and engine.max_in_flight == 2
    assert [c.prompt for c in baseline] == list(PROMPTS[:4]) * 3
    assert [c.prompt for c in replay] == list(PROMPTS[:4]) * 2  # interleaved
    # Neighbours (which overlap) go as different tenants; every prompt goes as every tenant.
    assert [c.tenant for c in replay] == ["alice", "bob"] * 2 + ["bob", "alice"] * 2
    assert all(not c.markers and not c.chat for c in engine.calls)
    body = replay[0].body
    assert (body["temperature"], body["seed"], body["max_tokens"], body["stream"]) == (0.0, 0, 32, False)
    assert (state["comparisons"], state["deviations"], state["runs"]) == (8 + DEFAULT_N, 0, 1)
    assert [e["output"] for e in state["baseline"]] == [p[:32] for p in PROMPTS[:4]]
    assert all(len(e["output_sha256"]) == 64 for e in state["baseline"])


def test_outputs_that_all_change_after_the_baseline_are_a_mismatch_and_keep_alarming() -> None:
    engine = FakeEngine()
    _, state = run(engine, 1)
    engine.reply = garble
    results, after = run(engine, 3, state)
    assert [(r.verdict, r.reason) for r in results] == [(Verdict.MISMATCH, "replay_diverged")] * 3
    m = results[0].measurements
    assert (m["deviations"], m["comparisons"], m["rate_tested"]) == (DEFAULT_N, DEFAULT_N, 0.1)
    assert m["p_value"] == pytest.approx(1e-8)
    # An alarmed run is not counted into the benign rate: a lasting fault cannot become the norm.
    assert after == state
    first = results[0].evidence["deviations"][0]
    assert first["common_prefix_chars"] == 0 and first["output_sha256"] != first["baseline_sha256"]


def test_a_small_benign_flip_rate_under_batching_never_alarms_while_a_real_divergence_does() -> None:
    rng = random.Random(20261130)
    engine = FakeEngine()
    flips = 0

    def batch_noise(call: Call) -> httpx.Response:
        nonlocal flips
        text = call.prompt[: call.body["max_tokens"]]
        # Batch effects: 2% of the outputs of concurrent replays differ in a late token (the
        # sequential baseline has none).
        if rng.random() < 0.02:
            flips += 1
            text = text[:-1] + "#"
        return answer(call, text)

    (baseline,), state = run(engine, 1)
    assert baseline.reason == "baseline_recorded"
    engine.reply = batch_noise
    results, state = run(engine, 200, state)
    verdicts = [r.verdict for r in results]
    assert verdicts.count(Verdict.MISMATCH) == 0 and verdicts == [Verdict.PASS] * 200
    assert flips > 10 and state["deviations"] == flips  # the rate was measured, about 2%
    assert 0.01 < state["deviations"] / state["comparisons"] < 0.04
    engine.reply = garble
    (alarm,), _ = run(engine, 1, state)
    assert (alarm.verdict, alarm.reason) == (Verdict.MISMATCH, "replay_diverged")


def test_a_model_that_is_not_deterministic_while_baselining_gets_no_baseline() -> None:
    count = 0

    def drifting(call: Call) -> httpx.Response:
        nonlocal count
        count += 1
        # The second of three sequential runs answers differently: 2 of 3 agree, per prompt.
        return answer(call, f"{call.prompt[:8]} {(count - 1) // 4 == 1}")

    (result,), state = run(FakeEngine(drifting), 1)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "not_deterministic")
    assert "model is not deterministic enough to baseline" in result.detail
    assert result.measurements["baseline_agreement"] == pytest.approx(8 / 12)
    assert result.state is None and state == {}


def test_rebaseline_true_records_anew_every_run_and_a_string_once_per_value() -> None:
    engine = FakeEngine()
    _, state = run(engine, 1)
    results, _ = run(engine, 2, state, rebaseline=True)
    assert [r.reason for r in results] == ["baseline_recorded"] * 2
    results, kept = run(engine, 2, state, rebaseline="2026-12-01 upgrade")
    assert [r.reason for r in results] == ["baseline_recorded", "replay_consistent"]
    assert results[0].evidence["rebaseline_reason"] == "requested"
    assert kept["rebaseline"] == "2026-12-01 upgrade"


def test_a_rebaseline_after_a_model_change_clears_the_alarm() -> None:
    engine = FakeEngine()
    _, state = run(engine, 1)
    engine.reply = garble  # new weights: every answer differs, legitimately
    (alarm,), state = run(engine, 1, state)
    assert alarm.verdict is Verdict.MISMATCH
    results, _ = run(engine, 2, state, rebaseline="new-weights")
    assert [r.verdict for r in results] == [Verdict.PASS] * 2


def test_other_prompts_or_settings_void_the_baseline() -> None:
    engine = FakeEngine()
    _, state = run(engine, 1)
    (result,), new = run(engine, 1, state, prompts=3)
    assert (result.reason, result.evidence["rebaseline_reason"]) == (
        "baseline_recorded",
        "conditions_changed",
    )
    assert len(new["baseline"]) == 3
    (result,), _ = run(engine, 1, new, prompts=3, max_tokens=16)
    assert result.evidence["rebaseline_reason"] == "conditions_changed"


def test_failed_replays_are_errors_and_only_the_answered_ones_are_counted() -> None:
    engine = FakeEngine()
    _, state = run(engine, 1)
    engine.reply = lambda call: error(503, "busy") if call.prompt == PROMPTS[0] else FakeEngine.echo(call)
    (result,), after = run(engine, 1, state)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "server_error")
    assert (result.measurements["comparisons"], result.measurements["failed_requests"]) == (6, 2)
    assert after["comparisons"] == state["comparisons"] + 6
    engine.reply = lambda call: error(500, "down")
    (result,), _ = run(engine, 1, state)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "server_error")


def test_a_divergence_outranks_failed_requests() -> None:
    engine = FakeEngine()
    _, state = run(engine, 1)

    def one_busy(call: Call) -> httpx.Response:
        return error(503, "busy") if (call.prompt, call.tenant) == (PROMPTS[0], "alice") else garble(call)

    engine.reply = one_busy
    (result,), _ = run(engine, 1, state)
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "replay_diverged")
    assert (result.measurements["comparisons"], result.measurements["failed_requests"]) == (7, 1)


def test_a_failed_baseline_request_is_an_error_that_keeps_no_state() -> None:
    (result,), kept = run(FakeEngine(lambda call: error(500, "down")), 1)
    assert (result.verdict, result.reason, result.state, kept) == (Verdict.ERROR, "server_error", None, {})


def test_too_few_comparisons_to_reach_alpha_are_an_error_not_a_pass() -> None:
    options = {"prompts": 1, "baseline_runs": 2, "repeats": 1}
    (baseline, result), _ = run(FakeEngine(), 2, **options)
    assert baseline.reason == "baseline_recorded"
    assert (result.verdict, result.reason) == (Verdict.ERROR, "replay_powerless")
    assert result.measurements["rate_tested"] == pytest.approx(1 / 3)


def test_another_tenants_marker_in_a_replay_is_a_leak_and_a_tainted_baseline_is_not_kept() -> None:
    book = MarkerBook()
    _, bobs = book.plant("ref", "bob")
    engine = FakeEngine(
        lambda call: answer(call, f"stale {bobs}") if call.tenant == "alice" else garble(call)
    )

    async def go():
        async with engine.target() as target:
            return await replay_runs(target, 1, book=book)

    (result,), state = asyncio.run(go())
    assert (result.verdict, result.evidence["probe_verdict"]) == (Verdict.LEAK, "error")
    assert result.evidence["leaks"][0]["owner_tenant"] == "bob" and state == {}
    assert bobs not in repr(result)


def test_the_prompts_hold_no_marker_and_differ_in_length() -> None:
    assert not any(MARKER_RE.search(p) for p in PROMPTS)
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    assert max(len(p.encode()) for p in PROMPTS) + 32 < 256


def test_the_probe_kind_is_replay() -> None:
    assert (ReplayProbe.kind, ReplayProbe.scope) == ("replay", "target")


# --- against the reference worker ------------------------------------------------------------------------


def test_the_reference_worker_replays_its_baseline_under_concurrent_load(shared_reference) -> None:
    async def go():
        async with shared_reference("aggregated").target() as target:
            return await replay_runs(target, 3)

    results, state = asyncio.run(go())
    assert [r.reason for r in results] == ["baseline_recorded", "replay_consistent", "replay_consistent"]
    assert state["deviations"] == 0 and state["comparisons"] == 8 + 2 * DEFAULT_N
    # The worker echoes: its outputs are the prompts' first 32 bytes.
    assert [e["output"] for e in state["baseline"]] == [p[:32] for p in PROMPTS[:4]]


# --- through the monitor's configuration and runner --------------------------------------------------


def test_the_config_refuses_bad_replay_options_and_the_runner_carries_the_state(monkeypatch) -> None:
    monkeypatch.setitem(REGISTRY, "replay", ReplayProbe)
    base = {"name": "ref", "base_url": "http://engine.test", "tenants": [{"name": "alice"}, {"name": "bob"}]}
    for bad in ({"concurrency": 0}, {"max_tokens": 64}, {"concurency": 2}, {"alpha": 0}):
        with pytest.raises(ValidationError):
            TargetConfig(**base, probes=["replay"], options={"replay": bad})
    config = TargetConfig(**base, probes=["replay"], options={"replay": {"concurrency": 3}})
    assert config.options == {"replay": {"concurrency": 3}}
    engine = FakeEngine(hold_seconds=0.25)  # three sent together overlap, however loaded the machine

    async def go() -> list[ProbeResult]:
        results: list[ProbeResult] = []
        state: dict[str, Any] = {}
        async with engine.target() as client:
            for _ in range(2):
                result, _ = await execute_probe("replay", client, MarkerBook(), config, state=state)
                state = result.state or state
                results.append(result)
        return results

    baseline, replay = asyncio.run(go())
    assert (baseline.reason, replay.reason) == ("baseline_recorded", "replay_consistent")
    assert engine.max_in_flight == 3
    # The scripted engine echoes: each output is its prompt's first 32 bytes (the first is shorter).
    assert replay.measurements["completion_tokens_spent"] == 2 * sum(len(p[:32]) for p in PROMPTS[:4])
