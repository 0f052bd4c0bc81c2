"""Cache salts and the PD transfer checksum against the SGLang engine itself (0.5.23, on this CPU).

- The paired salt check, tier by tier: SGLang 0.5.23 takes vLLM's ``cache_salt`` field into its
  radix key, reports ``cached_tokens`` (``--enable-cache-report``) and counts every hit under the
  tier that served it (``sglang:cached_tokens_total{cache_source}``: ``device`` here, no HiCache).
  The same salt must hit, in the device tier, and another salt must miss. kvcanary does not send a
  salt to SGLang unless told (``salt_check: true``): releases that take none would count every
  salted request as a hit under another salt.
- The checksum: ``disaggregation_enable_kv_checksum`` is a server argument, so ``/server_info``
  states it (false without the flag); kvcanary reads it as a fact. The engine runs aggregated here:
  its prefill/decode split needs CUDA (``docs/sglang-engine.md``), so no hand-off is checksummed
  and ``sglang:num_transfer_failed_reqs_total``, where a mismatch would be counted, has no series
  (a labelled counter appears with its first event; with the flag on, aggregated, it stays absent
  too). The hand-off itself is tested on the reference PD servers (``tests/workers/test_pd_checksum.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.prefix_cache import PrefixCacheProbe
from tests.sglang.server import SglangServer

pytestmark = pytest.mark.xdist_group("sglang")


def config(server: SglangServer, kind: str) -> TargetConfig:
    return TargetConfig(
        name="sglang",
        base_url=server.url,
        engine="sglang",
        model=server.model_name,
        tenants=[{"name": "alice"}, {"name": "bob"}],
        timeout_seconds=60,
        probes=[kind],
    )


def run(server: SglangServer, kind: str, **options: Any) -> ProbeResult:
    cfg = config(server, kind)

    async def go() -> ProbeResult:
        async with OpenAIHttpTarget(cfg, {"alice": None, "bob": None}) as target:
            if kind == "prefix_cache":
                return await PrefixCacheProbe().run(ProbeContext(target, MarkerBook(), options))
            result, _ = await execute_probe(kind, target, MarkerBook(), cfg, node=target.nodes[0])
            return result

    return asyncio.run(go())


def test_the_salt_holds_in_sglangs_device_tier_same_salt_hits_and_another_misses(
    sglang_server: SglangServer,
) -> None:
    # Without salts SGLang's radix cache is shared across tenants: recorded as such (policy shared).
    result = run(sglang_server, "prefix_cache", salt_check=True, policy="shared", prefix_tokens=512)
    assert (result.verdict, result.reason) == (Verdict.PASS, "shared_by_policy"), result.detail
    salt = result.evidence["salt_check"]
    assert (salt["verdict"], salt["reason"]) == ("pass", "cache_salt_honoured"), salt["detail"]
    assert salt["other_salt_gain_tokens"] == 0 and salt["same_salt_gain_tokens"] >= 256
    assert salt["tier_reading"]["present"] == ["device"]
    assert salt["tiers"]["device"]["verdict"] == "honoured"
    assert salt["tiers"]["device"]["same_salt_tokens"] == salt["same_salt_gain_tokens"]
    assert all(r["tiers_attributed"] for r in salt["requests"]), salt["requests"]
    print(f"SGLang salt check: {salt['detail']}; {result.measurements['tokens_spent']:.0f} tokens")


def test_sglang_states_its_transfer_checksum_and_an_aggregated_node_is_not_asked(
    sglang_server: SglangServer,
) -> None:
    capacity = run(sglang_server, "capacity")
    assert capacity.state is not None
    assert capacity.state["config"]["fact.disaggregation_enable_kv_checksum"] == "False"
    assert "kv_transfer_checksum" not in capacity.evidence  # aggregated: it hands nothing over
    counters = run(sglang_server, "counters")
    assert "kv_transfer_failures" in counters.evidence["missing"]  # no series without a PD hand-off
    assert "kv_checksum_failures" in counters.evidence["not_exposed"]  # SGLang counts none apart
