"""hangup: after a tenant abandons a request mid-answer, every next answer must be its own.

Against the reference worker with and without its ``abort-in-flight`` bug (a hung-up request
decodes on and its output goes to the next request admitted, as in the 2023 ChatGPT incident),
and at the network seam for the three ways the probe hangs up and for the abort counter.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.probes.base import Verdict
from kvcanary.probes.hangup import abandoned_prompt
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import (
    KEYS,
    Call,
    FakeEngine,
    Reference,
    answer,
    run_kind,
)


def judged(worker: Reference, **options: Any) -> tuple[Verdict, str, dict[str, Any]]:
    return run_kind("hangup", worker, **options)


#: A worker whose abandoned answers run long: the copy model writes 512 tokens in about 60 ms, and
#: on a loaded machine an answer that short was once over before the worker saw its client go (no
#: abort to count, rightly; and with the bug, no orphan to hand on). 4,096 tokens take it seconds.
LONG_ANSWERS = ("--mode", "aggregated", "--kv-pool-tokens", "16384", "--context-window", "16384")
BUGGY = (*LONG_ANSWERS, "--bug", "abort-in-flight")


def test_a_worker_that_stops_abandoned_requests_passes_and_counts_the_aborts(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = judged(reference(*LONG_ANSWERS), abandoned_max_tokens=4096)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    assert [a["step"] for a in evidence["abandoned"]] == ["mid_stream", "before_body", "client_timeout"]
    assert all(a["hung_up"] for a in evidence["abandoned"]), evidence["abandoned"]
    # Each hang-up reached the engine as an abort: the streams' at their next write, the plain
    # answer's through the handler watching for its client's disconnect.
    assert evidence["aborts_counted"] >= 3, evidence
    # ... each within the probe's wait, before its canaries went (a stream's abort once waited for
    # the garbage collector to close the worker's event generator), each waited for on its own.
    assert all(a["abort_seen_seconds"] is not None for a in evidence["abandoned"]), evidence["abandoned"]
    assert len(evidence["tenants"]) == 6


def test_a_worker_handing_an_abandoned_answer_to_the_next_request_is_caught(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = judged(reference(*BUGGY), abandoned_max_tokens=4096)
    # The next request admitted answers with the rest of the abandoned one: another tenant's
    # marker (a leak) or its own tenant's old one (its fresh nonce lost: a mismatch).
    assert (verdict, reason) == (Verdict.LEAK, "foreign_marker"), evidence
    assert evidence["leak_count"] >= 1 and evidence["probe_verdict"] == "mismatch", evidence


def test_an_abandoned_answer_handed_on_is_the_probes_mismatch_when_it_outlasts_the_timeout(reference) -> None:  # type: ignore[no-untyped-def]
    """The answer handed on is the orphan's 4,096 tokens: where the next request's timeout ends it
    first (on a loaded machine at 15 s; here at 2 s), what was read still carries the marker."""
    verdict, reason, evidence = run_kind("hangup", reference(*BUGGY), timeout=2, abandoned_max_tokens=4096)
    assert (verdict, reason) == (Verdict.LEAK, "foreign_marker"), evidence
    assert evidence["probe_verdict"] == "mismatch", evidence
    # judged in an answer its timeout ended:
    cut = [t for t in evidence["tenants"] if t["reason"] == "other_request_marker" and "2s" in t["error"]]
    assert cut, evidence["tenants"]


def sse_forever(call: Call) -> httpx.Response:
    """A stream that would go on for long: the probe must hang up on it, not read it to the end."""
    if not call.body.get("stream") or call.body["max_tokens"] < 200:
        return answer(call, call.prompt[: call.body["max_tokens"]])
    body = "".join(f'data: {{"choices": [{{"delta": {{"content": "{i}"}}}}]}}\n\n' for i in range(50))
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())


async def slow_json(call: Call) -> httpx.Response:
    if not call.body.get("stream") and call.body["max_tokens"] >= 200:
        await asyncio.sleep(2)
    return sse_forever(call)


def run_at_seam(
    fake: FakeEngine, engine: str = "llamacpp", timeout_seconds: float | None = None, **options: Any
) -> tuple[Verdict, str, dict[str, Any]]:
    async def go() -> tuple[Verdict, str, dict[str, Any]]:
        async with fake.target(engine=engine) as target:
            update: dict[str, Any] = {"probes": ["hangup"], "options": {"hangup": options}}
            if timeout_seconds is not None:
                update["timeout_seconds"] = timeout_seconds
            config = target._config.model_copy(update=update)
            result, _ = await execute_probe("hangup", target, MarkerBook(), config)
        return result.verdict, result.reason, result.evidence

    return asyncio.run(go())


def test_the_probe_hangs_up_three_ways_and_every_tenant_follows_each_time() -> None:
    fake = FakeEngine(reply=slow_json)
    verdict, reason, evidence = run_at_seam(fake)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    assert all(a["hung_up"] for a in evidence["abandoned"]), evidence["abandoned"]
    by_step = {a["step"]: a for a in evidence["abandoned"]}
    assert by_step["before_body"]["chars_read"] == 0
    assert 0 < by_step["mid_stream"]["chars_read"] < 50
    # llama.cpp counts no aborts: the count is not judged, and says so.
    assert evidence["aborts_counted"] is None
    abandoned = [c for c in fake.calls if c.body["max_tokens"] >= 200]
    assert [c.tenant for c in abandoned] == ["alice", "bob", "alice"]
    assert [c.body["stream"] for c in abandoned] == [True, True, False]


class SglangMetrics(FakeEngine):
    """Answers as ``slow_json`` and serves SGLang's abort counter, which never moves."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            page = "# TYPE sglang:num_aborted_requests_total counter\nsglang:num_aborted_requests_total 2.0\n"
            return httpx.Response(200, text=page)
        return await super().__call__(request)


def test_an_abort_count_that_stands_still_after_real_hang_ups_is_a_mismatch() -> None:
    verdict, reason, evidence = run_at_seam(SglangMetrics(reply=slow_json), engine="sglang")
    assert (verdict, reason) == (Verdict.MISMATCH, "abort_not_counted"), evidence
    assert evidence["aborts_counted"] == 0


def test_a_short_timeout_bounds_the_wait_for_a_late_count_so_the_run_is_judged_not_cut() -> None:
    """A 1 s timeout gives the run 11 s: the wait for a late abort count stops before that, and an
    engine that never counts gets its ``mismatch`` rather than a ``probe_timeout``."""
    fake = SglangMetrics(reply=slow_json)
    verdict, reason, evidence = run_at_seam(fake, engine="sglang", timeout_seconds=1.0)
    assert (verdict, reason) == (Verdict.MISMATCH, "abort_not_counted"), (reason, evidence)


class SlowToSeeAborts(FakeEngine):
    """Counts each abandoned request as aborted only ``lag`` seconds after it came (an engine that
    notices a client gone late), and keeps when each completion call came."""

    lag = 0.3

    def __init__(self) -> None:
        super().__init__(reply=slow_json)
        self.came: list[tuple[float, str, bool]] = []  # (when, tenant, abandoned)

    def aborted(self, now: float) -> int:
        return sum(1 for at, _, abandoned in self.came if abandoned and now - at >= self.lag)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        now = asyncio.get_running_loop().time()
        if request.url.path == "/metrics":
            name = "sglang:num_aborted_requests_total"
            page = f"# TYPE {name} counter\n{name} {self.aborted(now)}\n"
            return httpx.Response(200, text=page)
        if request.url.path.endswith("completions"):
            body = json.loads(request.content)
            tenant = next(t for t, k in KEYS.items() if request.headers.get("authorization") == f"Bearer {k}")
            self.came.append((now, tenant, body["max_tokens"] >= 200))
        return await super().__call__(request)


def test_canaries_follow_a_hang_up_once_the_engine_counted_it_the_tenant_that_hung_up_last() -> None:
    fake = SlowToSeeAborts()

    verdict, reason, evidence = run_at_seam(fake, engine="sglang")
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    starts = [i for i, (_, _, abandoned) in enumerate(fake.came) if abandoned]
    assert len(starts) == 3
    for n, i in enumerate(starts):
        at, abandoner, _ = fake.came[i]
        followers = fake.came[i + 1 : starts[n + 1] if n + 1 < len(starts) else None]
        # What an engine hands on goes to whoever it admits next: not before it saw the hang-up,
        # and another tenant first (here: bob and alice take turns hanging up).
        assert followers and all(when - at >= fake.lag for when, _, _ in followers), followers
        tenants = [t for _, t, _ in followers]
        assert tenants[-1] == abandoner and sorted(tenants) == ["alice", "bob"], followers


class CountsAfterTheRun(SlowToSeeAborts):
    """Counts the aborts only once all three hang-ups and their canaries are over (a loaded engine
    that noticed its clients go late): seconds after each hang-up's own wait gave up."""

    lag = 0.0

    def aborted(self, now: float) -> int:
        canaries = sum(1 for _, _, abandoned in self.came if not abandoned)
        return 3 if canaries >= 7 and now - self.came[-1][0] >= 1.0 else 0  # the lone one and 3 x 2


def test_an_abort_count_that_moves_only_after_the_run_is_waited_for_not_judged_a_mismatch() -> None:
    fake = CountsAfterTheRun()

    verdict, reason, evidence = run_at_seam(fake, engine="sglang")
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    assert evidence["aborts_counted"] == 3
    assert all(a["abort_seen_seconds"] is None for a in evidence["abandoned"])  # each wait gave up


class MissesTheFirstAbort(SlowToSeeAborts):
    """Counts every abandoned request but the first at once (its answer was over before the
    engine saw its client go: nothing left to abort)."""

    lag = 0.0

    def aborted(self, now: float) -> int:
        return max(0, super().aborted(now) - 1)


def test_a_hang_up_the_engine_never_counted_does_not_hold_up_the_next() -> None:
    async def go() -> dict[str, Any]:
        async with MissesTheFirstAbort().target(engine="sglang") as target:
            config = target._config.model_copy(update={"probes": ["hangup"]})
            result, _ = await execute_probe("hangup", target, MarkerBook(), config)
        return result.evidence

    evidence = asyncio.run(go())
    # Each hang-up is waited for from the count just before it: the first one's miss leaves the
    # others' waits alone (counted from the run's start, each would have waited out its 2 s).
    seen = [a["abort_seen_seconds"] for a in evidence["abandoned"]]
    assert seen[0] is None and None not in seen[1:], evidence["abandoned"]
    assert evidence["aborts_counted"] == 2


def test_the_abandoned_prompt_is_as_long_in_characters_as_its_answer_may_be_in_tokens() -> None:
    # An engine that echoes or continues the pattern then writes the whole budget, still writing
    # when the probe hangs up; no tokenizer makes fewer characters than tokens.
    for budget in (16, 512, 4096):
        prompt = abandoned_prompt("KVC-00-ab", budget)
        assert len(prompt) >= budget and prompt.count("KVC-00-ab") >= 2, budget
