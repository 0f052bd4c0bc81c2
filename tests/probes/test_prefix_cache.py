"""The prefix-cache probe: against reference workers (cache off, shared, per tenant) as processes, and
scripted caches at the network seam for what a worker cannot be made to do (ignore a salt).

The probe is not registered yet, so the tests run ``PrefixCacheProbe().run`` directly, as the runner would.
"""

from __future__ import annotations

import asyncio
import json
import random
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
from kvcanary.probes.prefix_cache.prompts import PromptSize
from kvcanary.probes.prefix_cache.timing import plan_timing
from kvcanary.probes.stats import exact_pvalue
from tests.probes.probe_harness import REFERENCE_INFO, Call, FakeEngine, Reference, answer, error
from tests.support import WorkerProcess, launch_worker, wait_worker
from tests.support.worker_keys import KEY_FLAGS

UNOBSERVABLE = "cannot judge: caching off or not reported"
# Timing needs prefixes whose prefill is a clear share of time to first token: the reference worker's
# prefill is cheap (an embedding write per token), so a 64 Ki-token prefix is a miss of ~0.18 s and a
# hit of ~0.04 s on a busy two-core machine (at 1,024 tokens the two are lost in the noise).
LONG = ("--kv-pool-tokens", "524288", "--context-window", "140000")
LONG_PREFIX = 65536
# alpha stays at the default 1e-8: D = 0.7 at alpha / 3 sizes 3 looks of 40 trials per arm; an idle
# machine decides at the first (10 to 15 s), a loaded one, whose contrast shrinks to D ~ 0.7, later.
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
    timing = result.evidence["timing"]
    assert (timing["plan"]["looks"], timing["plan"]["trials_per_look"], timing["looks_taken"]) == (3, 20, 3)
    assert timing["requests_sent"] == timing["plan"]["requests_planned"] == 240
    assert "not decisively faster than its misses" in result.detail and "after look 3 of 3" in result.detail


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
    # The worker counts its hits by tier: the one it has, the prefix cache's pages, was judged.
    assert salt["tier_reading"]["present"] == ["prefix"]
    assert salt["tiers"]["prefix"]["verdict"] == "honoured"
    assert salt["tiers"]["prefix"]["same_salt_tokens"] == salt["same_salt_gain_tokens"]
    assert all(r["tiers_attributed"] for r in salt["requests"])


def test_a_salt_header_the_engine_does_not_read_is_caught_when_the_operator_says_it_does(
    workers: Callable[[str], Reference],
) -> None:
    # The worker takes no salt header: every header request shares one unsalted domain, so its own
    # repeat hits (the half that can pass) and another header's request hits too; and the body's salt
    # decides the domain of a request that sends both (nothing else does).
    result = run_prefix(workers("per-tenant").target, salt_header="x-tenant-id")
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "cache_salt_header_ignored"), result.detail
    salt = result.evidence["salt_check"]
    assert salt["salt_header"] == "x-tenant-id"
    assert set(salt["findings"]) == {"cache_salt_header_ignored", "cache_salt_body_overrides_header"}
    roles = [r["role"] for r in salt["requests"]]
    assert roles[-4:] == ["header_cold", "header_same", "header_other", "header_forged"]


# --- salts tier by tier and by header, on workers with a session cache and a salt header ------------------

SESSION = ("--session-cache", "4")
SALT_HEADER = ("--cache-salt-header", "x-tenant-id")
SALT_WORKERS = {
    "session": (*SESSION, *SALT_HEADER),
    "offload-salt-dropped": (*SESSION, "--bug", "offload-salt-dropped"),
    "salt-body-over-header": ("--prefix-cache", "per-tenant", *SALT_HEADER, "--bug", "salt-body-over-header"),
}


@pytest.fixture(scope="module")
def salt_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Reference]]:
    """Return a worker of ``SALT_WORKERS`` by name, started on first use, stopped after the module."""
    started: dict[str, WorkerProcess] = {}
    log_dir = tmp_path_factory.mktemp("salt-workers")

    def get(name: str) -> Reference:
        if name not in started:
            started[name] = wait_worker(launch_worker([*SALT_WORKERS[name], *KEY_FLAGS], log_dir))
        return Reference(started[name].url)

    yield get
    for worker in started.values():
        worker.stop()


def test_a_salt_honoured_in_the_ring_and_in_the_offload_tier_passes_each_tier_on_its_own(
    salt_workers: Callable[[str], Reference],
) -> None:
    # The session cache keys by salt, not tenant: shared across tenants on purpose (policy shared).
    result = run_prefix(salt_workers("session").target, policy="shared")
    assert (result.verdict, result.reason) == (Verdict.PASS, "shared_by_policy"), result.detail
    salt = result.evidence["salt_check"]
    assert (salt["verdict"], salt["reason"]) == ("pass", "cache_salt_honoured"), salt["detail"]
    assert salt["tier_reading"]["present"] == ["session", "offload"]
    assert {t: r["verdict"] for t, r in salt["tiers"].items()} == {
        "session": "honoured",
        "offload": "honoured",
    }
    assert salt["tiers"]["offload"]["same_salt_tokens"] >= 1008
    # The offload tier was reached by pushing the prefix out of the ring (4 slots, and one more).
    roles = [r["role"] for r in salt["requests"]]
    assert sum(role.startswith("churn_offload_") for role in roles) == 5
    assert roles.index("offload_other") < roles.index("offload_same") < roles.index("header_cold")
    assert "in every tier (session, offload) by body and by header" in salt["detail"]
    assert result.measurements["tokens_spent"] <= result.measurements["tokens_planned"] * 1.05


def test_a_tier_that_drops_the_salt_the_ring_above_it_honours_is_caught_in_that_tier(
    salt_workers: Callable[[str], Reference],
) -> None:
    result = run_prefix(salt_workers("offload-salt-dropped").target, policy="shared")
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "cache_salt_ignored"), result.detail
    salt = result.evidence["salt_check"]
    assert salt["tiers"]["session"]["verdict"] == "honoured"
    assert salt["tiers"]["offload"]["verdict"] == "ignored"
    assert salt["tiers"]["offload"]["other_salt_tokens"] >= 1008
    assert "served by offload" in result.detail


def test_a_tier_the_budget_cannot_reach_is_not_judged_and_the_run_cannot_pass(
    salt_workers: Callable[[str], Reference],
) -> None:
    # Room for the counter test and the salt check by body and header, not for emptying the ring.
    result = run_prefix(salt_workers("session").target, policy="shared", max_tokens_per_run=12_000)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "cache_tier_not_exercised"), result.detail
    salt = result.evidence["salt_check"]
    assert salt["tiers"]["offload"]["verdict"] == "not_exercised"
    assert not any(r["role"].startswith("churn") for r in salt["requests"])
    assert "within the run's budget" in result.detail


def test_a_body_salt_that_overrides_the_gateways_header_is_a_mismatch(
    salt_workers: Callable[[str], Reference],
) -> None:
    result = run_prefix(salt_workers("salt-body-over-header").target)
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "cache_salt_body_overrides_header"), (
        result.detail
    )
    salt = result.evidence["salt_check"]
    forged = next(r for r in salt["requests"] if r["role"] == "header_forged")
    assert forged["cached_tokens"] >= 1008 and forged["tiers"] == {"prefix": forged["cached_tokens"]}
    assert set(salt["findings"]) == {"cache_salt_body_overrides_header"}


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
    looks = " ".join(
        f"[{look['look']}: cross D={look['cross']['d']:.3f} p={look['cross']['p']:.2g}, "
        f"control D={look['control']['d']:.3f} p={look['control']['p']:.2g}, "
        f"separation D={look['separation']['d']:.3f} p={look['separation']['p']:.2g}]"
        for look in timing["looks"]
    )
    print(
        f"timing on {mode}: {result.verdict} after {timing['looks_taken']} of 3 looks {looks}; medians "
        f"cross {m['ttft_cross_median_seconds']:.4f} s, repeat {m['ttft_repeat_median_seconds']:.4f} s, "
        f"miss {m['ttft_miss_median_seconds']:.4f} s; {timing['requests_sent']} requests, "
        f"{m['tokens_spent']:.0f} tokens in {m['timing_seconds']:.1f} s"
    )
    assert (result.verdict, result.reason) == (verdict, reason), result.detail
    plan, last = timing["plan"], timing["looks"][-1]
    assert (plan["looks"], plan["trials_per_look"], plan["alpha_per_look"]) == (3, 40, 1e-8 / 3)
    assert last["look"] == timing["looks_taken"] and last["decided"] is not None
    assert sum(last["trials"].values()) == 80 * timing["looks_taken"]
    assert len(timing["samples_ms"]["miss"]) == last["trials"]["miss"] and last["cross"]["method"] == "exact"
    assert timing["requests_sent"] <= plan["requests_planned"]
    assert m["ttft_repeat_median_seconds"] < m["ttft_miss_median_seconds"]


@pytest.mark.slow
def test_its_timing_test_raises_no_false_alarm_against_an_isolated_worker(
    workers: Callable[[str], Reference],
) -> None:
    # Small runs (3 looks of 20 trials per arm, 1,024-token prefixes): their hits show on a quiet
    # machine (a pass, often at the first look) and are lost in a loaded one's noise (an error after
    # every look). Every look is a chance of a false alarm (alpha / 3 each); what counts is that none
    # is a leak, and how small the cross arm's p ever got.
    target = workers("per-tenant").target
    results = [
        run_prefix(target, method="timing", prefix_tokens=1024, min_effect=1.0, victim_requests=1)
        for _ in range(FALSE_ALARM_RUNS)
    ]
    alarms = [r for r in results if r.verdict is Verdict.LEAK]
    looks = [look for r in results for look in r.evidence["timing"]["looks"]]
    pvalues = sorted(look["cross"]["p"] for look in looks)
    print(
        f"false alarms: {len(alarms)}/{len(results)} runs, {len(looks)} looks (alpha 1e-8, 3.3e-9 a look); "
        f"cross-arm p from {pvalues[0]:.3g} to {pvalues[-1]:.3g}, below 0.05 in "
        f"{sum(p < 0.05 for p in pvalues)}; verdicts {sorted(r.verdict.value for r in results)}"
    )
    assert not alarms
    assert all(r.evidence["method"] == "timing" for r in results)
    assert len(looks) == sum(r.evidence["timing"]["looks_taken"] for r in results) >= FALSE_ALARM_RUNS
    assert all(look["cross"]["p"] >= look["alpha"] for look in looks)


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


def test_it_cannot_judge_a_salt_whose_own_requests_never_hit() -> None:
    # Caching works (the counter test's control hit), salted requests are never reused: nothing
    # crossed, and a miss under another salt proves nothing, so the half cannot be judged.
    result = fake_run(FakeEngine(reply=ScriptedCache(salts="never_hit")))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "cache_salt_same_missed"), result.detail
    assert "cannot judge" in result.detail
    assert result.evidence["counter"]["verdict"] == "pass"


@dataclass
class TieredEngine(FakeEngine):
    """A scripted cache whose /metrics counts its hits in SGLang's per-tier counter, all in the device
    tier, plus ``busy`` tokens at every reading: another client's hits between two reads."""

    busy: int = 0
    hits: float = 0.0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            self.hits += self.busy
            return httpx.Response(
                200, text=f'sglang:cached_tokens_total{{cache_source="device"}} {self.hits}\n'
            )
        response = await super().__call__(request)
        if request.url.path.endswith("completions"):
            details = json.loads(response.content)["usage"].get("prompt_tokens_details") or {}
            self.hits += details.get("cached_tokens") or 0
        return response


def tiered(busy: int = 0, **info: Any) -> TieredEngine:
    return TieredEngine(reply=ScriptedCache(), busy=busy, info={**REFERENCE_INFO, **info})


def test_a_tier_reading_is_believed_only_when_it_adds_up_to_the_answers_own_count() -> None:
    quiet = fake_run(tiered(), engine="sglang", salt_check=True)
    salt = quiet.evidence["salt_check"]
    assert (salt["verdict"], salt["tiers"]["device"]["verdict"]) == ("pass", "honoured"), salt["detail"]
    assert all(r["tiers_attributed"] and not r["tiers_inferred"] for r in salt["requests"])
    # Another client's hits move the counter too: a node with one tier still has every hit in it.
    busy = fake_run(tiered(busy=100), engine="sglang", salt_check=True)
    salt = busy.evidence["salt_check"]
    assert (salt["verdict"], salt["tiers"]["device"]["verdict"]) == ("pass", "honoured"), salt["detail"]
    assert all(r["tiers_inferred"] for r in salt["requests"])


def test_with_two_tiers_a_busy_or_unreachable_lower_tier_cannot_pass() -> None:
    # HiCache's host tier is stated; this cache never moves a prefix there, and pushing the device
    # pool (1,024 tokens) out brings nothing to it: the host tier is never judged.
    quiet = fake_run(tiered(enable_hierarchical_cache=True), engine="sglang", salt_check=True)
    assert (quiet.verdict, quiet.reason) == (Verdict.ERROR, "cache_tier_not_exercised"), quiet.detail
    salt = quiet.evidence["salt_check"]
    assert salt["tier_reading"]["present"] == ["device", "host"]
    assert {t: r["verdict"] for t, r in salt["tiers"].items()} == {
        "device": "honoured",
        "host": "not_exercised",
    }
    assert (
        sum(r["role"].startswith("churn_host_") for r in salt["requests"])
        == salt["tier_reading"]["churn_requests"]["device"]
    )
    assert "did not bring it there" in quiet.detail
    busy = fake_run(tiered(busy=100, enable_hierarchical_cache=True), engine="sglang", salt_check=True)
    assert (busy.verdict, busy.reason) == (Verdict.ERROR, "cache_tier_not_exercised"), busy.detail
    assert "could not be told apart" in busy.detail


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


# --- the timing test's plan, looks and stops, against caches that answer by the clock -----------------

#: Small prefixes for the clock's caches: their misses wait, so the prefix's size is not what is timed.
CLOCKED = {"method": "timing", "prefix_tokens": 64, "victim_requests": 1, "max_tokens_per_run": UNBUDGETED}


@dataclass
class ClockedCache:
    """A prefix cache whose misses wait ``miss_seconds`` longer than its hits, every answer a random
    ``jitter_seconds`` more. ``sharing``: ``off`` (nothing hits), ``per-tenant`` (a tenant's own
    prefixes), ``shared`` (anyone's), or ``mostly`` (anyone's, but every 4th request of a prefix
    another tenant sent misses: a cache shared for three in four cross requests); ``fail_every``
    answers every n-th request with a 500."""

    sharing: str
    miss_seconds: float = 0.05
    # Noise as an engine's: without it hits would sit within a fraction of a millisecond of each other,
    # and any sub-millisecond order between the cross request and its repeat would look decisive.
    jitter_seconds: float = 0.01
    fail_every: int = 0
    senders: dict[str, set[str]] = field(default_factory=dict)
    crossings: int = 0
    answered: int = 0

    async def __call__(self, call: Call) -> httpx.Response:
        self.answered += 1
        if self.fail_every and self.answered % self.fail_every == 0:
            return error(500, "scripted failure")
        senders = self.senders.setdefault(call.prompt[:-8], set())  # the tail is 4 fresh letters
        hit = call.tenant in senders and self.sharing != "off"
        if senders and call.tenant not in senders:
            self.crossings += 1
            hit = self.sharing == "shared" or (self.sharing == "mostly" and self.crossings % 4 != 0)
        senders.add(call.tenant)
        await asyncio.sleep(random.uniform(0, self.jitter_seconds) + (0 if hit else self.miss_seconds))
        return answer(call, call.prompt[:1])


def clocked_run(cache: ClockedCache, **options: Any) -> ProbeResult:
    return fake_run(FakeEngine(reply=cache, hold_seconds=0), **{**CLOCKED, **options})


def size_of(tokens: int) -> PromptSize:
    return PromptSize(tokens, tokens, True, 1.0, 16, None, tokens)


def test_its_timing_plan_splits_alpha_over_looks_fixed_before_the_first_request() -> None:
    plan = plan_timing(size_of(1024), alpha=1e-8, min_effect=0.7, max_samples=256, victim_requests=1)
    assert (plan.looks, plan.trials_per_look, plan.samples_per_arm) == (3, 40, 120)
    assert plan.alpha_per_look == pytest.approx(1e-8 / 3)
    assert plan.requests == 120 * 4 and plan.tokens == 480 * 1030
    # The first look decides an effect of min_effect: its threshold is the exact one at alpha / 3.
    assert plan.detectable_effect == 27 / 40
    assert exact_pvalue(40, 40, 27 * 40) < 1e-8 / 3 <= exact_pvalue(40, 40, 26 * 40)
    assert plan.evidence()["detectable_effect_by_look"] == [27 / 40, 39 / 80, 48 / 120]
    # Fewer looks where max_samples cannot hold three, alpha split among those kept; one capped look
    # where it cannot hold even one.
    two = plan_timing(size_of(1024), alpha=1e-8, min_effect=0.7, max_samples=100, victim_requests=1)
    assert (two.looks, two.trials_per_look, two.alpha_per_look) == (2, 40, 5e-9)
    one = plan_timing(size_of(1024), alpha=1e-8, min_effect=0.7, max_samples=30, victim_requests=1)
    assert (one.looks, one.trials_per_look, one.samples_per_arm, one.wanted_per_arm) == (1, 30, 30, 120)


def test_its_default_timing_plan_fits_the_default_budget_with_every_look() -> None:
    opts = PrefixCacheOptions()
    plan = plan_timing(
        size_of(opts.prefix_tokens),
        alpha=opts.alpha,
        min_effect=opts.min_effect,
        max_samples=opts.max_samples,
        victim_requests=opts.victim_requests,
    )
    assert (plan.looks, plan.trials_per_look) == (3, 79)
    counter_attempt = opts.victim_requests * size_of(opts.prefix_tokens).request_tokens
    assert plan.tokens + counter_attempt <= opts.max_tokens_per_run


def test_it_says_error_before_any_request_when_no_timing_plan_can_reach_alpha() -> None:
    # 10 trials per arm, one look: even complete separation has p = 1/C(20, 10) = 5.4e-6.
    engine = FakeEngine(reply=ClockedCache("shared"), hold_seconds=0)
    result = fake_run(engine, **{**CLOCKED, "max_samples": 10})
    assert (result.verdict, result.reason) == (Verdict.ERROR, "alpha_unreachable"), result.detail
    plan = result.evidence["timing"]["plan"]
    assert (plan["looks"], plan["samples_per_arm"], plan["detectable_effect"]) == (1, 10, None)
    assert engine.calls == []


@pytest.mark.parametrize(
    ("sharing", "policy", "verdict", "reason"),
    [
        ("shared", "isolated", Verdict.LEAK, "prefix_cache_shared_across_tenants"),
        ("shared", "shared", Verdict.PASS, "shared_by_policy"),
        ("per-tenant", "isolated", Verdict.PASS, "prefix_cache_isolated"),
    ],
)
def test_its_timing_test_stops_at_the_first_look_that_decides(
    sharing: str, policy: str, verdict: Verdict, reason: str
) -> None:
    result = clocked_run(ClockedCache(sharing), min_effect=0.7, policy=policy)
    assert (result.verdict, result.reason) == (verdict, reason), result.detail
    timing = result.evidence["timing"]
    [look] = timing["looks"]
    assert (timing["looks_taken"], look["look"], look["alpha"]) == (1, 1, 1e-8 / 3)
    assert look["trials"]["hit"] + look["trials"]["miss"] == 80 and "at look 1 of 3" in result.detail
    assert timing["requests_sent"] == 2 * look["trials"]["hit"] + 80 < timing["plan"]["requests_planned"]
    assert 0 < timing["tokens_spent"] < timing["plan"]["tokens_planned"]


def test_its_timing_test_takes_every_look_then_names_the_threshold_that_failed() -> None:
    # No cache at all: nothing hits, so no look decides and the run spends its whole plan.
    result = clocked_run(ClockedCache("off", miss_seconds=0.002), min_effect=1.0)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "cache_unobservable"), result.detail
    timing = result.evidence["timing"]
    assert [look["look"] for look in timing["looks"]] == [1, 2, 3]
    assert [sum(look["trials"].values()) for look in timing["looks"]] == [40, 80, 120]
    assert all(look["decided"] is None and look["alpha"] == 1e-8 / 3 for look in timing["looks"])
    assert timing["requests_sent"] == timing["plan"]["requests_planned"] == 240
    control = timing["looks"][-1]["control"]
    assert re.search(
        rf"own repeats were not decisively faster than its misses: p = \S+, needs < 3.3e-9 "
        rf"\(D = {control['d']:.3f}, n = {control['n'][0]}/{control['n'][1]}\) after look 3 of 3",
        result.detail,
    ), result.detail


def test_its_timing_test_does_not_pass_a_cache_shared_for_most_cross_requests() -> None:
    # The repeats beat the misses by the whole contrast, the cross arm (three in four of them hits)
    # by three quarters of it, so the repeats' test is usually decisive a look before the cross arm's:
    # a pass on the repeats against the misses alone would pass this cache at that look.
    result = clocked_run(ClockedCache("mostly"), min_effect=1.0)
    looks = result.evidence["timing"]["looks"]
    print(
        "mostly shared: "
        + " ".join(
            f"[{look['look']}: cross p={look['cross']['p']:.2g}, control p={look['control']['p']:.2g}, "
            f"separation D={look['separation']['d']:.3f}]"
            for look in looks
        )
    )
    assert (result.verdict, result.reason) == (Verdict.LEAK, "prefix_cache_shared_across_tenants"), (
        result.detail
    )
    assert all(look["decided"] != "isolated" for look in looks)


def test_its_timing_test_stops_without_a_verdict_once_an_arm_lost_a_tenth_of_its_trials() -> None:
    result = clocked_run(ClockedCache("per-tenant", miss_seconds=0.002, fail_every=5), min_effect=1.0)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "requests_failed"), result.detail
    timing = result.evidence["timing"]
    assert timing["looks_taken"] == 0 and "by look 1" in result.detail
    assert timing["failed_requests"] and sum(timing["trials"].values()) == 40


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
