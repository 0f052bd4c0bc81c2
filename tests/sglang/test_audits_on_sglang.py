"""The zero-request audits against the SGLang engine itself, through the runner's one-run path
(``execute_probe``, as ``kvcanary check`` and the scheduler run a probe), and what each one read.

What SGLang 0.5.23 publishes decides what each audit can say:

- ``capacity``: the pool is ``max_total_num_tokens`` in ``/server_info`` (``--max-total-tokens``
  exactly); the window is not there (``context_length`` stays null without ``--context-length``),
  so it comes from ``sglang:context_len`` on ``/metrics`` or ``max_model_len`` on ``/v1/models``,
  which state the same number. The node states ``disaggregation_mode`` "null": aggregated.
- ``version``: ``version`` in ``/server_info`` says 0.5.23, past the one SGLang entry in the
  defects file (the PD placeholder of sglang#30233, fixed in 0.5.22).
- ``counters``: SGLang's prefix-cache counters are read (``sglang:cached_tokens_total`` only once
  some prompt hit the radix cache: the series has a label and appears with its first hit); no
  page-ownership, placeholder or dirty-reuse counter exists, so isolation cannot be judged:
  ``error`` "not_exposed".
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from tests.sglang.server import VERSION, SglangServer

pytestmark = pytest.mark.xdist_group("sglang")


def audit(server: SglangServer, kind: str, state: dict[str, Any] | None = None) -> ProbeResult:
    config = TargetConfig(
        name="sglang",
        base_url=server.url,
        engine="sglang",
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


def hit_the_radix_cache(server: SglangServer) -> None:
    body = {"model": server.model_name, "prompt": "A prompt sent twice. " * 4, "max_tokens": 1}
    for _ in range(2):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60.0).raise_for_status()


def test_capacity_reads_the_pool_sglang_was_given_and_its_context_window(sglang_server: SglangServer) -> None:
    result = audit(sglang_server, "capacity")
    assert (result.verdict, result.reason) == (Verdict.PASS, "headroom_ok"), result.detail
    assert result.evidence["pools"] == {"aggregated": sglang_server.kv_pool_tokens}
    assert result.evidence["source"].startswith("/server_info"), result.evidence  # the pool's
    assert result.evidence["context_window"] == sglang_server.context_len
    assert result.measurements["headroom_ratio"] == sglang_server.kv_pool_tokens / sglang_server.context_len


def test_version_reads_0_5_23_from_server_info_and_checks_the_sglang_defects(
    sglang_server: SglangServer,
) -> None:
    result = audit(sglang_server, "version")
    assert (result.verdict, result.reason) == (Verdict.PASS, "no_known_defect"), result.detail
    assert result.evidence["version"] == result.evidence["published_version"] == VERSION
    assert "sglang-pd-placeholder-30233" in result.evidence["checked"]


def test_counters_read_sglangs_cache_counters_and_say_isolation_cannot_be_judged(
    sglang_server: SglangServer,
) -> None:
    hit_the_radix_cache(sglang_server)
    result = audit(sglang_server, "counters")
    assert (result.verdict, result.reason) == (Verdict.ERROR, "not_exposed"), result.detail
    read = {s["counter"] for s in result.evidence["series"]}
    assert {"prefix_cache_queries", "prefix_cache_hits"} <= read, result.evidence
    assert {"ownership_violations", "placeholder_substitutions", "pages_reused_dirty"} <= set(
        result.evidence["not_exposed"]
    )
    again = audit(sglang_server, "counters", result.state)
    assert again.evidence["first_read"] is False  # the readings carry over, as on any engine
