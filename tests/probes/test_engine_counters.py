"""Engine counters beyond the reference worker's, judged on the engines' own metric pages.

The pages are the hand-written fixtures of ``tests/fixtures/engines/`` (SGLang 0.5.23's prefill node;
vLLM 0.32.0 with the NIXL and LMCache connectors; a broken variant) and vLLM 0.32.0's recorded page
``tests/fixtures/metrics/vllm.txt``, parsed by the monitor's own parser as a scrape is. Each test
fails when its counter, balance or gauge leaves ``probes/engine_counters.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcanary.monitor.targets.scrape import parse_samples
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.counters import judge_counters
from kvcanary.probes.target import Node

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NODE = Node("p0", "prefill", "http://p0", "http://p0/metrics")


def page(name: str) -> dict[str, float]:
    path = FIXTURES / "engines" / name if "/" not in name else FIXTURES / name
    return parse_samples(path.read_text())


SGLANG = page("sglang-0.5.23-metrics-prefill.txt")
VLLM_PD = page("vllm-0.32.0-metrics-nixl-lmcache-prefill.txt")
VLLM_SHORT = page("vllm-broken-metrics-prompt-sources-short.txt")
VLLM_RECORDED = page("metrics/vllm.txt")


def read(engine: str, samples: dict[str, float], previous: dict[str, Any] | None = None) -> ProbeResult:
    return judge_counters(engine, NODE, samples, previous or {}, zeroing=False, now=0.0)


def series(result: ProbeResult, counter: str) -> dict[str, Any]:
    return next(s for s in result.evidence["series"] if s["counter"] == counter)


def bumped(samples: dict[str, float], **by: float) -> dict[str, float]:
    """Return ``samples`` with every series of each counter named (``:`` written ``__``) and its sum
    raised by the amount given."""
    out = dict(samples)
    for name, amount in by.items():
        name = name.replace("__", ":")
        for key in [k for k in samples if k == name or k.startswith(name + "{")]:
            out[key] += amount
    return out


# --- SGLang --------------------------------------------------------------------------------------


def test_sglang_prefill_retries_and_pd_failures_are_read_as_evidence_never_judged() -> None:
    first = read("sglang", SGLANG)
    retries = series(first, "prefill_retries")
    assert (retries["series"], retries["after"]) == (["sglang:num_prefill_retries_total"], 3)
    failures = series(first, "kv_transfer_failures")
    assert failures["series"] == [
        "sglang:num_transfer_failed_reqs_total",
        "sglang:num_bootstrap_failed_reqs_total",
    ]
    assert failures["after"] == 1
    more = bumped(SGLANG, sglang__num_prefill_retries_total=5, sglang__num_bootstrap_failed_reqs_total=1)
    later = read("sglang", more, first.state)
    assert series(later, "prefill_retries")["increase"] == 5
    # Evidence only: SGLang still exposes no isolation counter (its KV canary only logs).
    assert (later.verdict, later.reason) == (Verdict.ERROR, "not_exposed")


# --- vLLM with NIXL ------------------------------------------------------------------------------


def test_vllm_nixl_lease_expiries_and_notification_failures_are_evidence() -> None:
    first = read("vllm", VLLM_PD)
    assert (first.verdict, first.reason) == (Verdict.PASS, "counters_clean"), first.detail
    assert series(first, "kv_lease_expiries")["series"] == ["vllm:nixl_num_kv_expired_reqs_total"]
    assert series(first, "kv_notification_failures")["series"] == ["vllm:nixl_num_failed_notifications_total"]
    later = bumped(
        VLLM_PD, vllm__nixl_num_kv_expired_reqs_total=4, vllm__nixl_num_failed_notifications_total=2
    )
    again = read("vllm", later, first.state)
    assert (
        series(again, "kv_lease_expiries")["increase"],
        series(again, "kv_notification_failures")["increase"],
    ) == (4, 2)
    assert again.verdict is Verdict.PASS, again.detail


def test_a_decode_read_of_released_kv_is_a_mismatch() -> None:
    first = read("vllm", VLLM_PD)
    late = read("vllm", bumped(VLLM_PD, vllm__nixl_num_notifications_after_expiry_total=1), first.state)
    assert (late.verdict, late.reason) == (Verdict.MISMATCH, "kv_read_after_release_increased")
    assert "kv_read_after_release +1" in late.detail


# --- the prompt-token balance -----------------------------------------------------------------------


def test_the_balance_holds_on_a_recorded_vllm_page_and_says_nothing_of_isolation() -> None:
    first = read("vllm", VLLM_RECORDED)
    again = read("vllm", VLLM_RECORDED, first.state)
    assert again.evidence["balances"]["prompt_token_sources"] == {"whole": 3356, "parts": 3356, "gap": 0}
    # A balance that holds is no isolation counter: default vLLM still cannot be judged.
    assert (again.verdict, again.reason) == (Verdict.ERROR, "not_exposed")


def test_prompt_tokens_short_of_their_sources_at_two_reads_in_a_row_are_a_mismatch() -> None:
    first = read("vllm", VLLM_SHORT)
    # One short read may be a scrape between the engine's two increments: recorded, not judged.
    assert first.verdict is Verdict.PASS and first.evidence["balances"]["prompt_token_sources"]["gap"] == 1024
    again = read("vllm", VLLM_SHORT, first.state)
    assert (again.verdict, again.reason) == (Verdict.MISMATCH, "prompt_token_sources_unbalanced")
    assert "1024 put down to none; 1024 at the previous read" in again.detail


def test_a_short_read_that_the_next_read_balances_was_a_scrape_between_increments() -> None:
    first = read("vllm", VLLM_SHORT)
    assert read("vllm", VLLM_PD, first.state).verdict is Verdict.PASS


def test_a_short_balance_is_a_finding_even_where_no_isolation_counter_exists() -> None:
    short = bumped(VLLM_RECORDED, vllm__prompt_tokens_total=512)
    again = read("vllm", short, read("vllm", short).state)
    assert (again.verdict, again.reason) == (Verdict.MISMATCH, "prompt_token_sources_unbalanced")


def test_a_restart_forgets_the_previous_processs_balance() -> None:
    short = bumped(VLLM_RECORDED, vllm__prompt_tokens_total=512)
    first = read("vllm", short)
    restarted = {**short, "process_start_time_seconds": short["process_start_time_seconds"] + 60}
    after = read("vllm", restarted, first.state)
    assert after.evidence["restarted"] is True and after.verdict is Verdict.ERROR
    # Short again at the read after: now two reads of the new process say so.
    assert read("vllm", restarted, after.state).verdict is Verdict.MISMATCH


def test_parts_above_the_whole_are_the_recomputed_token_of_some_releases_not_a_finding() -> None:
    over = bumped(VLLM_RECORDED, vllm__prompt_tokens_total=-3)
    assert read("vllm", over, read("vllm", over).state).verdict is Verdict.ERROR  # not_exposed, no finding


# --- LMCache's gauges inside vLLM ------------------------------------------------------------------


def test_lmcache_gauges_are_listed_with_the_series_off_their_sound_value() -> None:
    sound = {g["gauge"]: g for g in read("vllm", VLLM_PD).evidence["gauges"]}
    assert (sound["kv_load_error_blocks"]["value"], sound["kv_load_error_blocks"]["off"]) == (0, {})
    assert (sound["kv_offload_healthy"]["value"], sound["kv_offload_healthy"]["off"]) == (2, {})
    broken = read("vllm", VLLM_SHORT)
    off = {g["gauge"]: g for g in broken.evidence["gauges"]}
    assert off["kv_load_error_blocks"]["value"] == 16
    (unhealthy,) = off["kv_offload_healthy"]["off"]
    assert unhealthy.startswith("lmcache:lmcache_is_healthy{") and 'role="worker"' in unhealthy


def test_gauges_alone_never_change_a_verdict() -> None:
    first = read("vllm", VLLM_PD)
    unhealthy = {k: (0.0 if k.startswith("lmcache:lmcache_is_healthy") else v) for k, v in VLLM_PD.items()}
    assert read("vllm", unhealthy, first.state).verdict is Verdict.PASS
