"""duplicate_ids: tenants sending one client request id at once must each get their own answer.

Against the reference worker with and without its ``rid-collision`` bug (output routed by the
client's id, as SGLang kept one state per ``rid``), and at the network seam for what is sent.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx

from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import TENANTS, FakeEngine, Reference, run_kind

BUGGY = ("--mode", "aggregated", "--bug", "rid-collision")


def judged(worker: Reference, timeout: float = 5.0) -> tuple[Verdict, str, dict]:  # type: ignore[type-arg]
    return run_kind("duplicate_ids", worker, timeout=timeout)


def test_a_worker_keeping_requests_apart_passes(shared_reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = judged(shared_reference("aggregated"))
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact")
    assert [t["verdict"] for t in evidence["tenants"]] == ["pass", "pass"]


#: Runs the defect gets to show itself in: it acts only on requests in flight together, and under a
#: loaded machine one tenant's tiny answer can end before the other's request is read (one run in
#: CI's full suite passed so; 50 of 50 runs were caught here, idle and with both cores busy). The
#: probe runs every 300 s, so three runs are a quarter of an hour.
RUNS_TO_CATCH = 3


def test_a_worker_routing_output_by_the_client_id_is_caught(reference) -> None:  # type: ignore[no-untyped-def]
    worker = reference(*BUGGY)
    for _ in range(RUNS_TO_CATCH):
        verdict, reason, evidence = judged(worker)
        if verdict.is_failure:
            break
    # One tenant's answer takes both tenants' tokens (interleaved: no nonce survives whole), the
    # other's never comes: a wrong 200 and a hang, as with SGLang's overwritten rid state.
    assert verdict.is_failure, (verdict, reason, evidence)
    by_reason = sorted(t["reason"] for t in evidence["tenants"])
    assert "nonce_missing" in by_reason or "foreign_marker" in by_reason, evidence
    assert uuid.UUID(evidence["request_id"]).version == 4


class Recording(FakeEngine):
    """The reference worker's answers, keeping each completion's X-Request-Id header."""

    headers: list[str | None] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("completions"):
            self.headers.append(request.headers.get("x-request-id"))
        return await super().__call__(request)


def test_the_one_id_goes_in_the_header_the_user_field_and_rid_where_the_engine_takes_it() -> None:
    for engine, takes_rid in (("reference", True), ("sglang", True), ("vllm", False)):
        fake = Recording()
        fake.headers = []

        async def go(fake: Recording = fake, engine: str = engine) -> None:
            async with fake.target(engine=engine) as target:
                await execute_probe("duplicate_ids", target, MarkerBook(), target._config)

        asyncio.run(go())
        asked = [c for c in fake.calls if c.path.endswith("completions")]
        calls = [c for c in asked if "user" in c.body]
        ids = {c.body.get("user") for c in calls} | {h for h in fake.headers if h is not None}
        # One lone canary first, with no id (does the model repeat?), then one request per tenant.
        assert len(asked) == 3 and len(calls) == 2 and len(ids) == 1, (engine, ids)
        assert uuid.UUID(next(iter(ids))).version == 4  # llama-cpp-python refuses any other shape
        assert all(("rid" in c.body) is takes_rid for c in calls), engine
        assert {c.tenant for c in calls} == set(TENANTS)
