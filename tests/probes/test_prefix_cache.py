"""The prefix-cache probe: against reference workers (cache off, shared, per tenant) as processes, and
scripted caches at the network seam for what a worker cannot be made to do (ignore a salt).

The probe is not registered yet, so the tests run ``PrefixCacheProbe().run`` directly, as the runner would.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.markers import MARKER_RE, MarkerBook
from kvcanary.probes.prefix_cache import PrefixCacheOptions, PrefixCacheProbe
from tests.probes.probe_harness import Call, FakeEngine, Reference, error
from tests.support import WorkerProcess, launch_worker, wait_worker
from tests.support.worker_keys import KEY_FLAGS

UNOBSERVABLE = "cannot judge: caching off or not reported"
# Timing needs prefixes whose prefill is a clear share of time to first token: the reference worker's
# prefill is cheap (an embedding write per token), so a 64 Ki-token prefix is a miss of ~0.18 s and a
# hit of ~0.04 s on a busy two-core machine (at 1,024 tokens the two are lost in the noise).
LONG = ("--kv-pool-tokens", "524288", "--context-window", "140000")
LONG_PREFIX = 65536
# alpha stays at the default 1e-8; D = 0.7 needs 38 trials per arm (20 to 30 s per run here).
TIMING = {"method": "timing", "prefix_tokens": LONG_PREFIX, "min_effect": 0.7, "victim_requests": 1}
UNBUDGETED = 100_000_000
FALSE_ALARM_RUNS = 10


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Reference]]:
    """Return a worker per prefix-cache mode, started on first use, stopped after the module."""
    started: dict[str, WorkerProcess] = {}
    log_dir = tmp_path_factory.mktemp("prefix-workers")

    def get(mode: str) -> Reference:
        if mode not in started:
            extra = () if mode == "off" else LONG
            started[mode] = wait_worker(launch_worker(["--prefix-cache", mode, *extra, *KEY_FLAGS], log_dir))
        return Reference(started[mode].url)

    yield get
    for worker in started.values():
        worker.stop()


def run_prefix(target_factory: Callable[[], OpenAIHttpTarget], **options: Any) -> ProbeResult:
    """Run the probe once in a fresh event loop, with a target built inside it."""

    async def go() -> ProbeResult:
        async with target_factory() as target:
            return await PrefixCacheProbe().run(ProbeContext(target, MarkerBook(), options))

    return asyncio.run(go())


# --- counters and salts on the reference worker ---------------------------------------------------------


def test_it_says_error_not_pass_when_the_prefix_cache_is_off(workers: Callable[[str], Reference]) -> None:
    result = run_prefix(workers("off").target, method="counter")
    assert (result.verdict, result.reason) == (Verdict.ERROR, "cache_unobservable"), result.detail
    assert UNOBSERVABLE in result.detail
    assert result.evidence["counter"]["reported"] is False


@pytest.mark.slow
def test_it_falls_back_to_timing_and_still_says_error_when_no_hit_shows(
    workers: Callable[[str], Reference],
) -> None:
    # No counter with the cache off: auto turns to timing, whose control (the attacker's own repeats)
    # shows no hit either, so the run cannot judge isolation.
    result = run_prefix(workers("off").target, prefix_tokens=1024, min_effect=1.0, victim_requests=1)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "cache_unobservable"), result.detail
    assert result.evidence["method"] == "timing"
    assert result.measurements["samples_per_arm"] == 19


@pytest.mark.parametrize("chat", [False, True])
def test_it_reports_a_leak_when_one_tenants_prompt_warms_anothers_cache(
    workers: Callable[[str], Reference], chat: bool
) -> None:
    result = run_prefix(workers("shared").target, chat=chat)
    assert (result.verdict, result.reason) == (Verdict.LEAK, "prefix_cache_shared_across_tenants"), (
        result.detail
    )
    counter = result.evidence["counter"]
    assert result.evidence["method"] == "counter"
    assert counter["control_gain_tokens"] >= 1008  # all full 16-token pages of a ~1,024-token prefix
    [(attacker, gain)] = counter["attacker_gain_tokens"].items()
    assert attacker != counter["victim"] and gain >= 1008
    assert result.evidence["salt_check"]["reason"] == "cache_salt_honoured"
    spent = result.measurements["tokens_spent"]
    assert 0 < spent <= result.measurements["tokens_planned"] * 1.05
    print(f"counter + salt check, chat={chat}: {spent:.0f} tokens spent")


def test_it_passes_a_per_tenant_cache_whose_salts_are_honoured(workers: Callable[[str], Reference]) -> None:
    result = run_prefix(workers("per-tenant").target)
    assert (result.verdict, result.reason) == (Verdict.PASS, "prefix_cache_isolated"), result.detail
    assert list(result.evidence["counter"]["attacker_gain_tokens"].values()) == [0]
    salt = result.evidence["salt_check"]
    assert (salt["verdict"], salt["other_salt_gain_tokens"]) == ("pass", 0)
    assert salt["same_salt_gain_tokens"] >= 1008


def test_it_records_cross_tenant_hits_as_a_pass_under_the_shared_policy(
    workers: Callable[[str], Reference],
) -> None:
    result = run_prefix(workers("shared").target, policy="shared")
    assert (result.verdict, result.reason) == (Verdict.PASS, "shared_by_policy"), result.detail
    assert result.measurements["cross_tenant_cached_tokens"] >= 1008


# --- timing on the reference worker -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "verdict", "reason"),
    [
        ("shared", Verdict.LEAK, "prefix_cache_shared_across_tenants"),
        ("per-tenant", Verdict.PASS, "prefix_cache_isolated"),
    ],
)
def test_its_timing_test_tells_a_shared_cache_from_an_isolated_one(
    workers: Callable[[str], Reference], mode: str, verdict: Verdict, reason: str
) -> None:
    result = run_prefix(workers(mode).target, **TIMING, max_tokens_per_run=UNBUDGETED)
    timing, m = result.evidence["timing"], result.measurements
    print(
        f"timing on {mode}: D={m['ks_d']:.3f} p={m['ks_p']:.3g} control D={m['control_ks_d']:.3f} "
        f"n={m['samples_per_arm']:.0f}; medians cross {m['ttft_cross_median_seconds']:.4f} s, "
        f"repeat {m['ttft_repeat_median_seconds']:.4f} s, miss {m['ttft_miss_median_seconds']:.4f} s; "
        f"{m['tokens_spent']:.0f} tokens in {m['timing_seconds']:.1f} s"
    )
    assert (result.verdict, result.reason) == (verdict, reason), result.detail
    assert timing["plan"]["samples_per_arm"] == 38 and timing["cross"]["method"] == "exact"
    assert len(timing["samples_ms"]["miss"]) == 38
    assert m["ttft_repeat_median_seconds"] < m["ttft_miss_median_seconds"]


@pytest.mark.slow
def test_its_timing_test_raises_no_false_alarm_against_an_isolated_worker(
    workers: Callable[[str], Reference],
) -> None:
    # Small runs (19 trials per arm, 1,024-token prefixes): the control rarely shows hits at this
    # size, so most runs are errors; what counts is that none is a leak, and how small p ever got.
    target = workers("per-tenant").target
    results = [
        run_prefix(target, method="timing", prefix_tokens=1024, min_effect=1.0, victim_requests=1)
        for _ in range(FALSE_ALARM_RUNS)
    ]
    alarms = [r for r in results if r.verdict is Verdict.LEAK]
    pvalues = sorted(r.measurements["ks_p"] for r in results)
    print(
        f"false alarms: {len(alarms)}/{len(results)} runs (alpha 1e-8); cross-arm p from {pvalues[0]:.3g} "
        f"to {pvalues[-1]:.3g}; verdicts {sorted(r.verdict.value for r in results)}"
    )
    assert not alarms
    assert all(r.evidence["method"] == "timing" for r in results)


# --- scripted caches at the seam --------------------------------------------------------------------------

PAGE = 16


def cached_answer(call: Call, cached: int | None) -> httpx.Response:
    """Return a one-token answer whose usage reports ``cached`` tokens (None: no details at all)."""
    usage: dict[str, Any] = {"prompt_tokens": len(call.prompt.encode()), "completion_tokens": 1}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    text = call.prompt[:1]
    if not call.body.get("stream"):
        choice = {"message": {"role": "assistant", "content": text}} if call.chat else {"text": text}
        return httpx.Response(200, json={"choices": [{**choice, "finish_reason": "length"}], "usage": usage})
    piece = {"delta": {"content": text}} if call.chat else {"text": text}
    chunks = [{"choices": [{**piece, "finish_reason": "length"}]}, {"choices": [], "usage": usage}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())


@dataclass
class ScriptedCache:
    """A prefix cache of whole 16-byte pages per tenant. ``salts``: ``honour`` (as vLLM), ``ignore``
    (the defect: the salt is dropped) or ``never_hit`` (salted requests always miss). ``omit_zero``
    leaves out the counter when it is 0, as vLLM and SGLang do."""

    salts: str = "honour"
    omit_zero: bool = True
    refuse_salt: bool = False
    seen: dict[str, list[str]] = field(default_factory=dict)

    def __call__(self, call: Call) -> httpx.Response:
        salt = call.body.get("cache_salt")
        if salt is not None and self.refuse_salt:
            return error(400, "cache_salt is not supported")
        key = f"{call.tenant}|{salt}" if salt is not None and self.salts == "honour" else call.tenant
        prompt, earlier = call.prompt, self.seen.setdefault(key, [])
        common = max((_common_prefix(prompt, e) for e in earlier), default=0)
        earlier.append(prompt)
        cached = min(common, len(prompt) - 1) // PAGE * PAGE
        if salt is not None and self.salts == "never_hit":
            cached = 0
        return cached_answer(call, None if self.omit_zero and cached == 0 else cached)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def fake_run(
    fake: FakeEngine, tenants: tuple[str, ...] = ("alice", "bob"), engine: str = "reference", **options: Any
) -> ProbeResult:
    """Run the probe against ``fake`` as ``tenants`` of an ``engine`` target."""
    return run_prefix(lambda: fake.target(tenants, engine=engine), **options)


def test_it_reports_a_mismatch_when_the_engine_ignores_cache_salt() -> None:
    result = fake_run(FakeEngine(reply=ScriptedCache(salts="ignore")))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "cache_salt_ignored"), result.detail
    assert result.evidence["counter"]["verdict"] == "pass"  # tenants are isolated; the salt is not
    assert result.evidence["salt_check"]["other_salt_gain_tokens"] > 0


def test_it_reports_a_mismatch_when_a_salt_stops_even_its_own_requests_hitting() -> None:
    result = fake_run(FakeEngine(reply=ScriptedCache(salts="never_hit")))
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "cache_salt_same_missed"), result.detail


def test_it_says_error_when_the_engine_refuses_cache_salt() -> None:
    result = fake_run(FakeEngine(reply=ScriptedCache(refuse_salt=True)))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "cache_salt_refused"), result.detail


def test_it_reads_an_absent_counter_as_zero_once_any_response_carried_one() -> None:
    # vLLM omits cached_tokens when it is 0: the other tenant's answer has no counter at all.
    engine = FakeEngine(reply=ScriptedCache())
    result = fake_run(engine, salt_check=False)
    assert (result.verdict, result.reason) == (Verdict.PASS, "prefix_cache_isolated"), result.detail
    rows = result.evidence["counter"]["requests"]
    assert [r["cached_tokens"] for r in rows if r["role"] != "victim_repeat"] == [None, None]
    assert result.evidence["salt_check"]["verdict"] == "skipped"


def test_it_sends_only_fresh_random_text_never_a_marker_nor_the_same_prompt_twice() -> None:
    engine = FakeEngine(reply=ScriptedCache())
    fake_run(engine, engine="vllm")
    prompts = [call.prompt for call in engine.calls]
    assert len(prompts) == 6 and len(set(prompts)) == 6  # victim x2, attacker, salt check x3
    assert all(re.fullmatch(r"[a-z]( [a-z])*", p) for p in prompts)
    assert not any(MARKER_RE.search(p) for p in prompts)
    shared, salted = prompts[0][:-8], prompts[3][:-8]  # the tail is 4 fresh letters
    assert all(p.startswith(shared) for p in prompts[:3]) and all(p.startswith(salted) for p in prompts[3:])
    assert shared[:64] != salted[:64]
    assert [call.body["max_tokens"] for call in engine.calls] == [1] * 6


def test_it_says_error_before_any_request_when_the_plan_exceeds_the_budget() -> None:
    engine = FakeEngine(reply=ScriptedCache())
    for method in ("counter", "timing"):
        result = fake_run(engine, method=method, max_tokens_per_run=5000)
        assert (result.verdict, result.reason) == (Verdict.ERROR, "over_budget"), result.detail
        assert result.measurements["tokens_planned"] > 5000
    assert engine.calls == []


def test_it_says_error_when_counters_are_missing_and_timing_would_exceed_the_budget() -> None:
    engine = FakeEngine(reply=lambda call: cached_answer(call, None))
    result = fake_run(engine, max_tokens_per_run=50_000)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "over_budget"), result.detail
    assert result.evidence["counter"]["reported"] is False and len(engine.calls) == 2


def test_it_needs_two_tenants() -> None:
    result = fake_run(FakeEngine(reply=ScriptedCache()), tenants=("alice",))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "too_few_tenants")


def test_it_refuses_options_it_does_not_know_as_an_error() -> None:
    result = fake_run(FakeEngine(reply=ScriptedCache()), policy="sometimes")
    assert (result.verdict, result.reason) == (Verdict.ERROR, "bad_options")


def test_its_defaults_are_a_daily_isolated_audit_at_alpha_1e_8() -> None:
    opts = PrefixCacheOptions()
    assert (opts.policy, opts.method, opts.prefix_tokens, opts.alpha, opts.min_effect) == (
        "isolated",
        "auto",
        1024,
        1e-8,
        0.5,
    )
    assert PrefixCacheProbe.default_interval_seconds == 86400
