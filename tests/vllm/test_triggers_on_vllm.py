"""The trigger kinds against a real vLLM server (CPU build, tiny random-weight model): no false alarm.

A random-weight model repeats no nonce: every kind's lone canary says so, and each run judges
foreign (and other requests') markers only, saying so (``judged: foreign_markers_only``). What is
real and checked here is everything else: vLLM takes every request each kind sends (shared
prefixes under fresh ``cache_salt``s, per-tenant system messages, hang-ups three ways, multi-turn
histories, a full batch with ``repetition_penalty``, stop strings and ``n`` = 2), answers none of
them with another request's marker, and never serves a first request under
a fresh salt from the cache. Its abort series (``vllm:request_success_total{finished_reason="abort"}``)
does not count a client's hang-up (measured here: 0 after 9), so the hang-up kind does not judge
it on vLLM. Each kind runs :data:`RUNS` times, its state carried as the runner does.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvcanary.monitor.targets.scrape import parse_samples
from kvcanary.probes.base import ProbeResult, Verdict
from tests.support.engine_runs import repeated_runs
from tests.support.vllm import VllmServer

pytestmark = pytest.mark.vllm

RUNS = 3
#: The session's churn, bounded here: sized from vLLM's pool it would be 262,144 tokens on the CPU.
OPTIONS: dict[str, dict[str, Any]] = {"session": {"churn_tokens": 4096}}


def runs(server: VllmServer, kind: str) -> list[ProbeResult]:
    return repeated_runs(server.url, "vllm", server.model_name, kind, RUNS, OPTIONS)


def abort_series(server: VllmServer) -> float:
    samples = parse_samples(httpx.get(f"{server.url}/metrics", timeout=10).text)
    return sum(v for k, v in samples.items() if k.startswith("vllm:request_success_total{") and "abort" in k)


def test_vllm_does_not_count_a_client_hang_up_as_an_abort(vllm_server: VllmServer) -> None:
    before = abort_series(vllm_server)
    results = runs(vllm_server, "hangup")
    assert all(a["hung_up"] for r in results for a in r.evidence["abandoned"])
    # Had this moved, ABORT_COUNTERS should list vLLM again: the hang-up kind would then judge it.
    assert abort_series(vllm_server) == before


@pytest.mark.parametrize("kind", ["duplicate_ids", "shared_prefix", "hangup", "session", "full_batch"])
def test_a_trigger_kind_raises_no_false_alarm_on_vllm(vllm_server: VllmServer, kind: str) -> None:
    results = runs(vllm_server, kind)
    said = [(r.verdict, r.reason, r.detail[:200]) for r in results]
    # No false alarm: never a leak or a mismatch. A run the CPU server failed under a loaded
    # machine (it dropped a connection of a 32-row batch once in a full suite) is an error,
    # which pages for nothing; the others must pass, and one at least.
    passed = [r for r in results if r.verdict == Verdict.PASS]
    assert all(r.verdict in (Verdict.PASS, Verdict.ERROR) for r in results), said
    assert passed and all(r.reason == "no_foreign_marker" for r in passed), said
    assert all(r.evidence["judged"] == "foreign_markers_only" for r in passed)
    if kind == "hangup":
        for r in results:
            assert all(a["hung_up"] for a in r.evidence["abandoned"]), r.evidence["abandoned"]
            assert r.evidence["aborts_counted"] is None, r.evidence  # not judged on vLLM
    if kind == "shared_prefix":  # the salted step ran, and no fresh salt hit the cache
        steps = {t["step"] for r in results for t in r.evidence["tenants"]}
        assert {"concurrent", "sequential", "salted", "system"} <= steps
    if kind == "full_batch":
        assert all(r.evidence["batch_size"] == 32 for r in results)
