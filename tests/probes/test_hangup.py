"""hangup: after a tenant abandons a request mid-answer, every next answer must be its own.

Against the reference worker with and without its ``abort-in-flight`` bug (a hung-up request
decodes on and its output goes to the next request admitted, as in the 2023 ChatGPT incident),
and at the network seam for the three ways the probe hangs up and for the abort counter.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from monitor.runs.execute import execute_probe
from probes.base import Verdict
from probes.markers import MarkerBook
from tests.probes.probe_harness import (
    Call,
    FakeEngine,
    Reference,
    answer,
    run_kind,
)

BUGGY = ("--mode", "aggregated", "--kv-pool-tokens", "4096", "--bug", "abort-in-flight")


def judged(worker: Reference, **options: Any) -> tuple[Verdict, str, dict[str, Any]]:
    return run_kind("hangup", worker, **options)


def test_a_worker_that_stops_abandoned_requests_passes_and_counts_the_aborts(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = judged(reference("--mode", "aggregated", "--kv-pool-tokens", "4096"))
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    assert [a["step"] for a in evidence["abandoned"]] == ["mid_stream", "before_body", "client_timeout"]
    assert all(a["hung_up"] for a in evidence["abandoned"]), evidence["abandoned"]
    # Each hang-up reached the engine as an abort: the streams' at their next write, the plain
    # answer's through the handler watching for its client's disconnect.
    assert evidence["aborts_counted"] >= 3, evidence
    assert len(evidence["tenants"]) == 6


def test_a_worker_handing_an_abandoned_answer_to_the_next_request_is_caught(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = judged(reference(*BUGGY))
    # The next request admitted answers with the rest of the abandoned one: another tenant's
    # marker (a leak) or its own tenant's old one (its fresh nonce lost: a mismatch).
    assert (verdict, reason) == (Verdict.LEAK, "foreign_marker"), evidence
    assert evidence["leak_count"] >= 1 and evidence["probe_verdict"] == "mismatch", evidence


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


def run_at_seam(fake: FakeEngine, **options: Any) -> tuple[Verdict, str, dict[str, Any]]:
    async def go() -> tuple[Verdict, str, dict[str, Any]]:
        async with fake.target(engine="llamacpp") as target:
            config = target._config.model_copy(update={"probes": ["hangup"], "options": {"hangup": options}})
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
    async def go() -> tuple[Verdict, str, dict[str, Any]]:
        async with SglangMetrics(reply=slow_json).target(engine="sglang") as target:
            config = target._config.model_copy(update={"probes": ["hangup"]})
            result, _ = await execute_probe("hangup", target, MarkerBook(), config)
        return result.verdict, result.reason, result.evidence

    verdict, reason, evidence = asyncio.run(go())
    assert (verdict, reason) == (Verdict.MISMATCH, "abort_not_counted"), evidence
    assert evidence["aborts_counted"] == 0
