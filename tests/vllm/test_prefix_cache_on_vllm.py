"""The prefix-cache probe against a real vLLM server (CPU build), prefix caching on as by default.

- Plain vLLM shares its prefix cache across tenants (nothing salts their requests): the counter
  test must find it, a ``leak``.
- Behind ``salt_gateway.py``, which sets a per-tenant secret ``cache_salt`` from each API key, the
  tenants are isolated: the probe must ``pass``.
- The paired salt check (same salt hits, a different salt does not) passes on vLLM either way; on
  the plain server it reads which tier served each request from
  ``vllm:prompt_tokens_cached_by_source_total`` (the device tier, the only one a CPU build has).

The server is started with ``--enable-prompt-tokens-details`` (without it vLLM reports no
``cached_tokens`` and ``auto`` would fall back to timing) and 32-token blocks; its 1,024-token
``max_model_len`` caps the prefix at 960 tokens, 30 blocks. This build reports ``cached_tokens: 0`` on
a miss; other versions omit the field when it is 0 (docs/engines.md §3), which the probe reads as 0
once any response of the run carried it (``tests/probes/test_prefix_cache.py`` scripts that case).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.prefix_cache import PrefixCacheProbe
from tests.support.vllm import VllmServer
from tests.vllm.salt_gateway import SaltGateway

pytestmark = pytest.mark.vllm

TENANTS = ("alice", "bob")
KEYS = {"kvc-gw-key-alice": "alice", "kvc-gw-key-bob": "bob"}


def run_probe(url: str, server: VllmServer, keys: dict[str, str | None], **options: Any) -> ProbeResult:
    """Run the prefix-cache probe once against ``url`` as the tenants of ``keys`` (tenant -> key)."""
    config = TargetConfig(
        name="vllm-cpu",
        base_url=url,
        engine="vllm",
        model=server.model_name,
        tenants=[{"name": tenant} for tenant in keys],
        timeout_seconds=60,
        probes=["canary"],
    )

    async def go() -> ProbeResult:
        async with OpenAIHttpTarget(config, keys) as target:
            return await PrefixCacheProbe().run(ProbeContext(target, MarkerBook(), options))

    return asyncio.run(go())


@pytest.fixture(scope="module")
def gateway(vllm_server: VllmServer) -> Iterator[SaltGateway]:
    """A salt gateway in front of the session's vLLM server, stopped after the module."""
    proxy = SaltGateway(vllm_server.url, KEYS)
    proxy.start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def plain(vllm_server: VllmServer) -> ProbeResult:
    return run_probe(vllm_server.url, vllm_server, {tenant: None for tenant in TENANTS})


@pytest.fixture(scope="module")
def salted(vllm_server: VllmServer, gateway: SaltGateway) -> ProbeResult:
    keys: dict[str, str | None] = {tenant: key for key, tenant in KEYS.items()}
    return run_probe(gateway.url, vllm_server, keys)


def test_plain_vllm_shares_one_tenants_prefix_with_another(plain: ProbeResult) -> None:
    assert (plain.verdict, plain.reason) == (Verdict.LEAK, "prefix_cache_shared_across_tenants"), plain.detail
    counter, prefix = plain.evidence["counter"], plain.evidence["prefix"]
    assert plain.evidence["method"] == "counter"
    assert (prefix["page_size"], prefix["admission_limit"]) == (32, 1024)
    assert prefix["prefix_tokens"] <= 1024 - 64
    [gain] = counter["attacker_gain_tokens"].values()
    assert gain >= prefix["prefix_tokens"] - 64  # every full 32-token block of the prefix
    cold, repeat = counter["requests"][:2]
    assert cold["cached_tokens"] in (0, None) and repeat["cached_tokens"] == counter["control_gain_tokens"]
    print(f"plain vLLM: {plain.detail}; {plain.measurements['tokens_spent']:.0f} tokens")


def test_the_paired_salt_check_passes_on_vllm(plain: ProbeResult, salted: ProbeResult) -> None:
    for result in (plain, salted):
        salt = result.evidence["salt_check"]
        assert (salt["verdict"], salt["reason"]) == ("pass", "cache_salt_honoured"), salt["detail"]
        assert salt["other_salt_gain_tokens"] == 0 and salt["same_salt_gain_tokens"] > 0


def test_vllm_counts_the_salted_hit_in_its_device_tier_and_the_check_judges_that_tier(
    plain: ProbeResult,
) -> None:
    # vllm:prompt_tokens_cached_by_source_total{source} moves by what each answer's cached_tokens
    # says: the same salt's hit is the device tier's, the only tier this server has.
    salt = plain.evidence["salt_check"]
    assert salt["tier_reading"]["present"] == ["device"]
    assert salt["tiers"] == {
        "device": {"present": True, "verdict": "honoured", "same_salt_tokens": salt["same_salt_gain_tokens"]}
    }
    assert all(r["tiers_attributed"] for r in salt["requests"]), salt["requests"]


def test_vllm_behind_a_per_tenant_salt_gateway_isolates_tenants(
    salted: ProbeResult, gateway: SaltGateway
) -> None:
    assert (salted.verdict, salted.reason) == (Verdict.PASS, "prefix_cache_isolated"), salted.detail
    counter = salted.evidence["counter"]
    assert list(counter["attacker_gain_tokens"].values()) == [0]
    assert counter["requests"][2]["cached_tokens"] in (0, None)  # a miss
    assert counter["control_gain_tokens"] >= salted.evidence["prefix"]["prefix_tokens"] - 64
    assert all(count >= 1 for count in gateway.salted.values())
    print(f"vLLM behind the salt gateway: {salted.detail}; {salted.measurements['tokens_spent']:.0f} tokens")


def test_the_gateway_refuses_unknown_keys_and_relays_streams(
    gateway: SaltGateway, vllm_server: VllmServer
) -> None:
    body = {"model": vllm_server.model_name, "prompt": "a b c d", "max_tokens": 4, "stream": True}
    refused = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == 401
    headers = {"Authorization": "Bearer kvc-gw-key-alice"}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and "choices" in json.loads(events[0])
    assert httpx.get(gateway.url + "/v1/models", timeout=30).json()["data"][0]["id"] == vllm_server.model_name
