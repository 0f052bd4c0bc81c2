"""The counters probe: worker counters judged between reads, on real reference workers.

Each scene provokes what the counter counts through the worker's real HTTP API (an over-capacity
request on the defective worker, a foreign page caught by verified ownership, dirty reuse) and
checks the verdict, the reason and the before/after evidence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.counters import judge_counters
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import Node
from tests.probes.probe_harness import (
    AGGREGATED,
    DISAGG,
    KEYS,
    MODEL,
    PLACEHOLDER,
    Reference,
    loopback_target,
)
from tests.workers.pd_support import as_gateway, pd_body, start_servers, stop_servers

NODE = Node("", "aggregated", "http://w", "http://w/metrics")
PROMPT_A = "ALICE-PAGE-CONTENT " * 30  # 570 bytes: several pages of tenant A
OVER_CAPACITY = "B" * 1500  # over the 1024-token prefill pool, inside the 8192 context window


def counters_config(url: str, **options: Any) -> TargetConfig:
    return TargetConfig(
        name="ref",
        base_url=url,
        engine="reference",
        model=MODEL,
        tenants=[{"name": "alice"}, {"name": "bob"}],
        probes=["counters"],
        options={"counters": options} if options else {},
    )


def read(url: str, state: dict[str, Any] | None = None, **options: Any) -> ProbeResult:
    """Run the counters probe once on the worker at ``url`` with the previous ``state``."""
    config = counters_config(url, **options)

    async def go() -> ProbeResult:
        async with OpenAIHttpTarget(config, {"alice": KEYS["alice"], "bob": KEYS["bob"]}) as target:
            result, _ = await execute_probe("counters", target, MarkerBook(), config, state=state)
            return result

    return asyncio.run(go())


def send(url: str, prompt: str, tenant: str, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        timeout=30,
    )


def series(result: ProbeResult, counter: str) -> dict[str, Any]:
    return next(s for s in result.evidence["series"] if s["counter"] == counter)


def test_a_clean_worker_passes_and_says_what_its_engine_does_not_expose(
    reference: Callable[..., Reference],
) -> None:
    worker = reference(*AGGREGATED)
    first = read(worker.url)
    assert (first.verdict, first.reason) == (Verdict.PASS, "counters_clean")
    assert first.evidence["first_read"] is True
    assert set(first.evidence["not_exposed"]) == {
        "corrupted_requests", "kv_read_after_release", "kv_lease_expiries", "kv_notification_failures",
        "prefill_retries", "preemptions", "engine_canary_violations", "engine_canary_write_violations",
    }  # fmt: skip
    send(worker.url, PROMPT_A, "alice")
    second = read(worker.url, first.state)
    assert second.verdict is Verdict.PASS and second.evidence["first_read"] is False
    checks = series(second, "ownership_violations")
    assert (checks["before"], checks["after"], checks["increase"]) == (0, 0, 0)


def test_a_corrupted_hand_off_the_checksum_refused_is_evidence_for_the_decode_node_not_a_finding(
    tmp_path: Path,
) -> None:
    # The checksum caught K/V altered between two servers and failed the request closed: the
    # engine's guard working, on a path that corrupts. Evidence for the node; no answer was wrong.
    checksum = ("--kv-checksum", "--api-key", f"{KEYS['alice']}=alice")
    prefills, decodes = start_servers(
        tmp_path, {"corrupt": ("reject", *checksum, "--bug", "pd-transfer-corrupt")}, {"checking": checksum}
    )
    try:
        corrupt, checking = prefills["corrupt"], decodes["checking"]
        baseline = read(checking.url)
        _, decode = as_gateway(corrupt, checking, pd_body(PROMPT_A, corrupt), key=KEYS["alice"])
        assert decode.status_code == 500 and "kv_checksum_mismatch" in decode.text
        after = read(checking.url, baseline.state)
    finally:
        stop_servers(prefills, decodes)
    assert (after.verdict, after.reason) == (Verdict.PASS, "counters_clean"), after.detail
    assert series(after, "kv_checksum_failures")["increase"] == 1
    assert series(after, "kv_transfer_failures")["increase"] == 1
    assert series(after, "kv_checksum_failures")["series"] == ["kvcanary_kv_transfer_checksum_failures_total"]


def test_a_placeholder_substitution_between_reads_is_a_mismatch_with_before_and_after(
    reference: Callable[..., Reference],
) -> None:
    worker = reference(*PLACEHOLDER)
    baseline = read(worker.url)
    assert baseline.verdict is Verdict.PASS
    assert send(worker.url, OVER_CAPACITY, "bob").status_code == 200  # the defect: 200, not 400
    after = read(worker.url, baseline.state)
    assert (after.verdict, after.reason) == (Verdict.MISMATCH, "placeholder_substitutions_increased")
    found = series(after, "placeholder_substitutions")
    assert (found["before"], found["after"], found["increase"]) == (0, 1, 1)
    assert found["series"] == ["kvcanary_placeholder_substitutions_total"]
    # Read again with nothing new: the finding holds through the lookback, saying so (no pass that
    # reads as a recovery), and a lookback of 0 judges the read alone.
    held = read(worker.url, after.state)
    assert (held.verdict, held.reason) == (Verdict.MISMATCH, "placeholder_substitutions_increased")
    assert "+1 in the last 900 s" in held.detail and "+0 since the previous read" in held.detail
    assert read(worker.url, after.state, lookback_seconds=0).verdict is Verdict.PASS


def test_an_ownership_violation_caught_by_the_worker_is_a_leak(reference: Callable[..., Reference]) -> None:
    worker = reference(*PLACEHOLDER, "--verify-ownership")
    baseline = read(worker.url)
    send(worker.url, PROMPT_A, "alice")
    refused = send(worker.url, OVER_CAPACITY, "bob", max_tokens=64)
    assert refused.status_code == 500 and refused.json()["error"]["type"] == "kv_ownership_violation"
    after = read(worker.url, baseline.state)
    assert (after.verdict, after.reason) == (Verdict.LEAK, "ownership_violations_increased")
    assert series(after, "ownership_violations")["increase"] == 1
    assert "placeholder_substitutions +1" in after.detail  # the cause is named beside it


def test_dirty_reuse_is_judged_only_where_freed_pages_must_be_zeroed(
    reference: Callable[..., Reference],
) -> None:
    worker = reference(*DISAGG)
    baseline = read(worker.url)
    for tenant in ("alice", "bob", "alice"):
        send(worker.url, PROMPT_A, tenant)
    lenient = read(worker.url, baseline.state)
    assert lenient.verdict is Verdict.PASS and series(lenient, "pages_reused_dirty")["increase"] > 0
    strict = read(worker.url, baseline.state, require_zeroed_pages=True)
    assert (strict.verdict, strict.reason) == (Verdict.MISMATCH, "pages_reused_dirty_increased")


def test_a_zeroing_worker_says_so_itself_and_reuses_no_dirty_page(
    reference: Callable[..., Reference],
) -> None:
    worker = reference(*DISAGG, "--zero-freed-pages")
    baseline = read(worker.url)
    assert baseline.evidence["zeroing_required"] is True  # from its kvcanary_worker_info
    for tenant in ("alice", "bob", "alice"):
        send(worker.url, PROMPT_A, tenant)
    after = read(worker.url, baseline.state)
    assert after.verdict is Verdict.PASS and series(after, "pages_reused_dirty")["increase"] == 0


# --- the arithmetic, on recorded values --------------------------------------------------------


def judged(samples: dict[str, float], previous: dict[str, Any], engine: str = "reference") -> ProbeResult:
    return judge_counters(engine, NODE, samples, previous, zeroing=False)


REFERENCE_ZERO = {
    "kvcanary_kv_ownership_violations_total": 0.0,
    "kvcanary_placeholder_substitutions_total": 0.0,
    "kvcanary_kv_pages_reused_dirty_total": 0.0,
}


def test_a_restarted_worker_counts_from_zero_again() -> None:
    before = {"counters": {"placeholder_substitutions": 7.0, "ownership_violations": 0.0}}
    restarted = {**REFERENCE_ZERO, "kvcanary_placeholder_substitutions_total": 2.0}
    result = judged(restarted, before)
    assert result.verdict is Verdict.MISMATCH
    assert series(result, "placeholder_substitutions")["increase"] == 2  # not -5


def vllm_page(corrupted: dict[str, float], started: float = 1000.0) -> dict[str, float]:
    """A vLLM page as parse_samples reads it: one corrupted_requests series per data-parallel engine."""
    page = {f'vllm:corrupted_requests_total{{engine="{e}"}}': v for e, v in corrupted.items()}
    page["vllm:corrupted_requests_total"] = sum(corrupted.values())
    page["process_start_time_seconds"] = started
    return page


def test_one_data_parallel_engine_restarting_is_not_the_node_starting_again() -> None:
    # Engine 1 of two restarted (its series back to 0): the sum drops, yet nothing new happened.
    # Taken on the sum, the drop would read as a restart of all, and engine 0's 100 as new: a false mismatch.
    first = judged(vllm_page({"0": 100.0, "1": 50.0}), {}, "vllm")
    later = judged(vllm_page({"0": 100.0, "1": 0.0}), first.state or {}, "vllm")
    assert later.verdict is Verdict.PASS, later.detail
    assert series(later, "corrupted_requests")["increase"] == 0
    # One new corruption on engine 1 after its restart counts once.
    after = judged(vllm_page({"0": 100.0, "1": 1.0}), later.state or {}, "vllm")
    assert (after.verdict, series(after, "corrupted_requests")["increase"]) == (Verdict.MISMATCH, 1)


def test_a_series_missing_from_one_page_is_not_new_when_it_comes_back() -> None:
    first = judged(vllm_page({"0": 100.0, "1": 50.0}), {}, "vllm")
    gap = judged(vllm_page({"0": 100.0}), first.state or {}, "vllm")
    back = judged(vllm_page({"0": 100.0, "1": 50.0}), gap.state or {}, "vllm")
    assert (gap.verdict, back.verdict) == (Verdict.PASS, Verdict.PASS), back.detail


def test_a_restart_is_seen_even_when_the_counter_climbed_back_to_its_old_value() -> None:
    # One violation, the engine restarted as the fix, one new violation before the next read: the
    # value is 1 again, and only the process's start time says it is a new one.
    before = {
        **REFERENCE_ZERO,
        "kvcanary_kv_ownership_violations_total": 1.0,
        "process_start_time_seconds": 10.0,
    }
    first = judged(before, {})
    again = {**before, "process_start_time_seconds": 20.0}
    result = judged(again, first.state or {})
    assert (result.verdict, result.reason) == (Verdict.LEAK, "ownership_violations_increased")
    assert result.evidence["restarted"] is True and series(result, "ownership_violations")["increase"] == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp", "openai"])
def test_an_engine_without_isolation_counters_cannot_be_judged(engine: str) -> None:
    result = judged({"vllm:prefix_cache_queries_total": 10.0}, {}, engine)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "not_exposed")
    assert "ownership_violations" in result.evidence["not_exposed"]


def test_a_counter_the_engine_should_export_but_did_not_is_reported_missing() -> None:
    samples = dict(REFERENCE_ZERO)
    del samples["kvcanary_kv_pages_reused_dirty_total"]
    result = judged(samples, {})
    assert result.verdict is Verdict.PASS and "pages_reused_dirty" in result.evidence["missing"]


def test_metrics_that_are_not_prometheus_text_or_not_there_are_errors() -> None:
    async def go(body: str | None) -> ProbeResult:
        def answer(request: httpx.Request) -> httpx.Response:
            if body is None:
                return httpx.Response(503, text="down")
            return httpx.Response(200, text=body)

        config = counters_config("http://engine.test")
        async with loopback_target(config, {}, answer) as target:
            return (await execute_probe("counters", target, MarkerBook(), config))[0]

    assert asyncio.run(go(None)).reason == "metrics_unreachable"
    assert asyncio.run(go("<html>this is no metrics page {{{")).reason == "metrics_unparseable"


def placeholder_page(substitutions: float) -> dict[str, float]:
    return {**REFERENCE_ZERO, "kvcanary_placeholder_substitutions_total": substitutions}


def test_a_fault_that_recurs_every_other_read_fails_every_read_and_passes_once_it_stops() -> None:
    # The demo's defective target: the monitor's own boundary run substitutes one request every
    # other read. Judged read by read it flipped pass, mismatch, pass, ...; over the lookback it
    # fails throughout, then passes once the last substitution is older than the lookback.
    state: dict[str, Any] = judge_counters("reference", NODE, placeholder_page(0), {}, zeroing=False,
                                           now=0.0, lookback_seconds=900).state or {}  # fmt: skip
    verdicts = []
    for i, total in enumerate([1, 1, 2, 2, 3, 3], start=1):
        result = judge_counters("reference", NODE, placeholder_page(total), state, zeroing=False,
                                now=30.0 * i, lookback_seconds=900)  # fmt: skip
        state = result.state or {}
        verdicts.append(result.verdict)
    assert verdicts == [Verdict.MISMATCH] * 6
    assert [r["increases"] for r in state["recent"]] == [{"placeholder_substitutions": 1}] * 3
    quiet = judge_counters("reference", NODE, placeholder_page(3), state, zeroing=False,
                           now=150.0 + 901, lookback_seconds=900)  # fmt: skip
    assert (quiet.verdict, quiet.evidence["recent_increases"]) == (Verdict.PASS, [])


def test_a_restarted_node_is_not_held_to_what_the_process_before_it_did() -> None:
    # The fix deployed: the engine restarted (a new process_start_time_seconds) with its counters at
    # 0. Its first read passes, though the old process substituted within the lookback.
    old = {**placeholder_page(0), "process_start_time_seconds": 10.0}
    state = judge_counters("reference", NODE, old, {}, zeroing=False, now=0.0, lookback_seconds=900).state
    faulty = {**placeholder_page(2), "process_start_time_seconds": 10.0}
    state = judge_counters("reference", NODE, faulty, state or {}, zeroing=False, now=30.0,
                           lookback_seconds=900).state  # fmt: skip
    fixed = {**placeholder_page(0), "process_start_time_seconds": 50.0}
    result = judge_counters(
        "reference", NODE, fixed, state or {}, zeroing=False, now=60.0, lookback_seconds=900
    )
    assert (result.verdict, result.evidence["restarted"]) == (Verdict.PASS, True), result.detail
