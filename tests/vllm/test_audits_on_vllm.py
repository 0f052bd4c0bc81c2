"""The zero-request audits against a real vLLM server: counters, capacity and version.

vLLM is an engine nobody here wrote. What it publishes decides what each audit can say:

- ``counters``: vLLM exports no page-ownership, placeholder or dirty-reuse counter, so the probe
  cannot judge isolation from its metrics: ``error`` "not_exposed", never a pass; the counters it
  does map (prefix-cache queries and hits, preemptions, admission rejections) are read and listed.
- ``capacity``: the pool from ``vllm:cache_config_info`` (blocks x block size), the window from
  ``/v1/models``; vLLM refuses to start with a pool below one max-length request, so it passes.
- ``version``: ``/version`` says 0.32.0, newer than every vLLM entry in the defects file: pass.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from tests.support.vllm import VllmServer

pytestmark = pytest.mark.vllm


def audit(server: VllmServer, kind: str, state: dict[str, Any] | None = None) -> ProbeResult:
    config = TargetConfig(
        name="vllm",
        base_url=server.url,
        engine="vllm",
        model=server.model_name,
        tenants=[{"name": "alice"}],
        probes=[kind],
    )

    async def go() -> ProbeResult:
        async with OpenAIHttpTarget(config, {"alice": None}) as target:
            result, _ = await execute_probe(
                kind, target, MarkerBook(), config, node=target.nodes[0], state=state
            )
            return result

    return asyncio.run(go())


def test_counters_say_what_vllm_exposes_and_that_isolation_cannot_be_judged(vllm_server: VllmServer) -> None:
    result = audit(vllm_server, "counters")
    assert (result.verdict, result.reason) == (Verdict.ERROR, "not_exposed")
    read = {s["counter"] for s in result.evidence["series"]}
    assert {"prefix_cache_queries", "prefix_cache_hits", "preemptions", "admission_rejections"} <= read
    assert {"ownership_violations", "placeholder_substitutions", "pages_reused_dirty"} <= set(
        result.evidence["not_exposed"]
    )
    assert "corrupted_requests" in result.evidence["missing"]  # mapped, but only with NaN checks on
    again = audit(vllm_server, "counters", result.state)
    assert again.evidence["first_read"] is False  # the readings carry over, as on any engine


def test_capacity_reads_the_pool_from_cache_config_info_and_the_window_from_v1_models(
    vllm_server: VllmServer,
) -> None:
    result = audit(vllm_server, "capacity")
    assert result.verdict is Verdict.PASS, result.detail
    assert result.evidence["context_window"] == vllm_server.max_model_len
    (pool,) = result.evidence["pools"].values()
    assert pool % vllm_server.block_size == 0 and pool >= vllm_server.max_model_len


def test_version_finds_no_known_defect_in_this_vllm(vllm_server: VllmServer) -> None:
    result = audit(vllm_server, "version")
    assert (result.verdict, result.reason) == (Verdict.PASS, "no_known_defect"), result.detail
    assert result.evidence["version"].startswith("0.32")
