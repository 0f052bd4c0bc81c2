"""The version probe: each node's engine release and facts against the known isolation defects.

Engines nobody here wrote answer through the response shapes their sources produce
(tests/fixtures/engines), served at the network seam to the real HTTP client; the reference worker
runs as a real process. No scene may send a completion.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import Completion, CompletionRequest, Node
from kvcanary.probes.version import VersionProbe
from tests.probes.probe_harness import KEYS, MODEL, Reference, loopback_target

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ENGINES = FIXTURES / "engines"
PD_DEFECT = "sglang-pd-placeholder-30233"
CACHE_SALT_CVE = "vllm-prefix-cache-timing-cve-2025-46570"
HASH_CVE = "vllm-prefix-hash-collision-cve-2025-25183"
SLOT_GHSA = "vllm-slot-stale-tokens-ghsa-v97p-wpxp-px84"
FORCED_END_GHSA = "vllm-thinking-end-forced-ghsa-fpch-3xrf-7q96"
LOGITS_CVE = "vllm-allowed-token-ids-logits-cve-2026-93840"
CONDENSE_CVE = "vllm-allowed-token-ids-condense-cve-2026-114049"
VLLM_METRICS = (FIXTURES / "metrics" / "vllm.txt").read_text()
VLLM_MODELS = (FIXTURES / "vllm" / "models.json").read_text()

Body = str | dict[str, Any]


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Register the kind for these tests only: the registry line is the integrator's to add."""
    monkeypatch.setitem(REGISTRY, "version", VersionProbe)
    yield


def fixture(name: str) -> str:
    return (ENGINES / name).read_text()


def variant(name: str, **changes: Any) -> dict[str, Any]:
    """Return fixture ``name`` (a JSON object) with ``changes`` applied at the top level."""
    body: dict[str, Any] = json.loads(fixture(name))
    body.update(changes)
    return body


class Seam:
    """Serve ``{path: body}`` on loopback (anything else: 404) and keep every path asked."""

    def __init__(self, bodies: dict[str, Body]):
        self.bodies = bodies
        self.paths: list[str] = []

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        body = self.bodies.get(request.url.path)
        if body is None:
            return httpx.Response(404, json={"object": "error", "message": "Not Found", "code": 404})
        return httpx.Response(200, text=body if isinstance(body, str) else json.dumps(body))


def config(url: str, engine: str, nodes: list[dict[str, str]] | None = None, **options: Any) -> TargetConfig:
    return TargetConfig(
        name="t",
        base_url=url,
        engine=engine,
        model=MODEL,
        tenants=[{"name": "alice"}],
        probes=["version"],
        options={"version": options} if options else {},
        nodes=nodes or [],
    )


def check(cfg: TargetConfig, seam: Seam | None = None, node: Node | None = None) -> ProbeResult:
    """Run the version probe as the runner would; fail the test if it asked for any completion."""
    asked: list[CompletionRequest] = []

    async def go() -> ProbeResult:
        keys: dict[str, str | None] = {"alice": KEYS["alice"]}
        made = loopback_target(cfg, keys, seam.answer) if seam else OpenAIHttpTarget(cfg, keys)
        async with made as target:

            async def no_completion(tenant: str, request: CompletionRequest) -> Completion:
                asked.append(request)
                return Completion(status=None, error="the version probe must not send completions")

            target.complete = no_completion  # type: ignore[method-assign]
            # The node as the target sees it: on loopback, its address was moved with the config's.
            chosen = next((n for n in target.nodes if node and n.name == node.name), target.nodes[0])
            result, _ = await execute_probe("version", target, MarkerBook(), cfg, node=chosen)
            return result

    result = asyncio.run(go())
    assert asked == []
    assert not any(p.endswith("completions") for p in (seam.paths if seam else []))
    assert result.measurements["prompt_tokens_spent"] == 0
    return result


def sglang(body: Body, path: str = "/server_info", **options: Any) -> ProbeResult:
    return check(config("http://sglang.test", "sglang", **options), Seam({path: body}))


def vllm(version: Body, metrics: str | None = VLLM_METRICS, **options: Any) -> ProbeResult:
    bodies: dict[str, Body] = {"/version": version, "/v1/models": VLLM_MODELS}
    if metrics is not None:
        bodies["/metrics"] = metrics
    return check(config("http://vllm.test", "vllm", **options), Seam(bodies))


# --- SGLang: the incident and its fix -------------------------------------------------------------


@pytest.mark.parametrize(
    "node", ["sglang-0.5.11-prefill-incident.json", "sglang-0.5.11-decode-incident.json"]
)
def test_the_incidents_pd_nodes_are_a_mismatch_naming_the_defect(node: str) -> None:
    result = sglang(fixture(node), path="/get_server_info")  # what 0.5.11 answers; /server_info is a 404
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "known_isolation_defect")
    assert result.detail.startswith(
        f"{PD_DEFECT} applies to sglang 0.5.11 (affected <0.5.22, fixed in 0.5.22; "
    )
    assert "https://github.com/sgl-project/sglang/issues/30233" in result.detail
    [defect] = result.evidence["defects"]
    assert (defect["id"], defect["affected"], defect["fixed_in"]) == (PD_DEFECT, "<0.5.22", "0.5.22")
    assert result.evidence["version"] == "0.5.11" and result.evidence["checked"] == [PD_DEFECT]
    assert result.evidence["facts"] == {
        "disaggregation_mode": json.loads(fixture(node))["disaggregation_mode"]
    }
    assert result.measurements["known_defects"] == 1


@pytest.mark.parametrize("node", ["sglang-0.5.22-prefill-fixed.json", "sglang-0.5.22-decode-fixed.json"])
def test_the_fixed_release_passes(node: str) -> None:
    result = sglang(fixture(node))
    assert (result.verdict, result.reason) == (Verdict.PASS, "no_known_defect")
    assert result.detail == "no known defect for sglang 0.5.22 (1 entries checked)"
    assert result.evidence["defects"] == [] and result.evidence["unknown"] == []


def test_an_affected_release_without_disaggregation_passes() -> None:
    result = sglang(fixture("sglang-0.5.11-single-context-null.json"))
    assert (result.verdict, result.reason) == (Verdict.PASS, "no_known_defect")
    assert result.evidence["facts"] == {"disaggregation_mode": "null"}  # SGLang's word for "not PD"


def test_the_pd_gateway_answers_with_its_prefill_nodes_body() -> None:
    result = sglang(fixture("sglang-gateway-pd-server_info.json"))
    assert (result.verdict, result.evidence["defects"][0]["id"]) == (Verdict.MISMATCH, PD_DEFECT)


def test_a_mini_lb_answer_without_node_facts_is_unknown_not_clean() -> None:
    # The router's combined answer keeps one version and no node's server arguments.
    result = sglang(fixture("sglang-router-mini_lb-get_server_info.json"), path="/get_server_info")
    assert (result.verdict, result.reason) == (Verdict.ERROR, "fact_unknown")
    assert "does not publish disaggregation_mode (needs prefill or decode)" in result.detail
    assert "server arguments in /server_info" in result.detail


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        ("sglang-broken-nulls.json", "version null"),
        ("sglang-broken-wrong-types.json", "version a float"),
        ("sglang-broken-missing-fields.json", "no version key"),
    ],
)
def test_a_version_that_is_not_a_string_is_an_error_naming_it(broken: str, why: str) -> None:
    result = sglang(fixture(broken))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "version_unknown"), why
    assert result.detail.startswith("sglang version not published: looked for `version` in /server_info")
    assert "http://127.0.0.1:" in result.detail and result.evidence["published_version"] is None


def test_a_source_build_is_unknown_until_the_operator_states_its_release() -> None:
    body = variant("sglang-0.5.22-prefill-fixed.json", version="0.0.0.dev123+gabc")
    result = sglang(body)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "version_unknown")
    assert "'0.0.0.dev123+gabc' is a source or CI build" in result.detail
    stated = sglang(body, version="0.5.22")
    assert (stated.verdict, stated.evidence["version_from"]) == (Verdict.PASS, "stated")
    assert stated.detail.startswith("no known defect for sglang 0.5.22 (stated by the operator)")
    assert sglang(body, version="0.5.11").verdict is Verdict.MISMATCH


def test_a_published_release_wins_over_a_stale_stated_one() -> None:
    result = sglang(fixture("sglang-0.5.11-prefill-incident.json"), version="0.5.22")
    assert (result.verdict, result.evidence["version_from"]) == (Verdict.MISMATCH, "published")
    assert result.evidence["stated_version"] == "0.5.22"


def test_an_accepted_defect_is_recorded_not_judged() -> None:
    result = sglang(fixture("sglang-0.5.11-prefill-incident.json"), ignore=[PD_DEFECT])
    assert (result.verdict, result.reason) == (Verdict.PASS, "known_defect_accepted")
    assert result.evidence["ignored"] == [
        {"id": PD_DEFECT, "status": "applies", "why": "0.5.11 is inside <0.5.22"}
    ]
    assert result.evidence["defects"] == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ignore": ["sglang-no-such-defect"]}, "version.ignore: Value error, unknown defect id(s)"),
        ({"version": "banana"}, "version.version: Value error, 'banana' is not a PEP 440 version"),
        ({"versoin": "0.5.22"}, "version.versoin: Extra inputs are not permitted"),
    ],
)
def test_bad_options_are_refused_when_the_config_loads(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        config("http://sglang.test", "sglang", **options)


def test_an_unreachable_node_is_an_error_that_says_where_it_looked(unreachable: Reference) -> None:
    result = check(config(unreachable.url, "sglang"))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "version_unknown")
    assert "cannot read" in result.detail and unreachable.url in result.detail


def test_each_listed_node_is_judged_at_its_own_address() -> None:
    seam = Seam(
        {
            "/p0/server_info": fixture("sglang-0.5.22-prefill-fixed.json"),
            "/d0/get_server_info": fixture("sglang-0.5.11-decode-incident.json"),
        }
    )
    nodes = [
        {"name": "p0", "role": "prefill", "info_url": "http://sglang.test/p0"},
        {"name": "d0", "role": "decode", "info_url": "http://sglang.test/d0"},
    ]
    cfg = config("http://sglang.test", "sglang", nodes=nodes)
    prefill, decode = cfg.node_list()
    assert check(cfg, seam, prefill).verdict is Verdict.PASS
    result = check(cfg, seam, decode)
    assert (result.verdict, result.evidence["node"], result.evidence["role"]) == (
        Verdict.MISMATCH,
        "d0",
        "decode",
    )


# --- vLLM -----------------------------------------------------------------------------------------


def test_vllm_0_32_passes_with_prefix_caching_on() -> None:
    result = vllm(fixture("vllm-0.32.0-version.json"))
    assert (result.verdict, result.reason) == (Verdict.PASS, "no_known_defect")
    # The critical entry first, then the file's order.
    vllm_ids = [SLOT_GHSA, CACHE_SALT_CVE, HASH_CVE, FORCED_END_GHSA, LOGITS_CVE, CONDENSE_CVE]
    assert result.evidence["checked"] == vllm_ids
    assert result.evidence["facts"] == {
        "enable_prefix_caching": "True", "async_scheduling": None, "pipeline_parallel_size": None
    }  # fmt: skip


def test_vllm_0_8_5_with_prefix_caching_is_a_mismatch_for_the_cache_salt_cve() -> None:
    result = vllm({"version": "0.8.5"})
    assert (result.verdict, result.reason) == (Verdict.MISMATCH, "known_isolation_defect")
    assert result.detail.startswith(
        f"{CACHE_SALT_CVE} applies to vllm 0.8.5 (affected <0.9.0, fixed in 0.9.0; "
    )
    assert "GHSA-4qjh-9fv9-r85r" in result.detail
    # 0.8.5 has the hash fix; the allowlist CVEs of 2026 reach back to every release.
    assert [d["id"] for d in result.evidence["defects"]] == [CACHE_SALT_CVE, LOGITS_CVE, CONDENSE_CVE]


def test_every_defect_that_applies_is_in_the_evidence() -> None:
    result = vllm({"version": "0.7.1"})
    ids = [CACHE_SALT_CVE, HASH_CVE, LOGITS_CVE, CONDENSE_CVE]
    assert [d["id"] for d in result.evidence["defects"]] == ids
    assert result.detail.endswith(f", and 3 more: {', '.join(ids[1:])}")
    assert result.measurements["known_defects"] == 4


def test_vllm_0_8_5_with_prefix_caching_off_is_clear_of_the_cache_salt_cve() -> None:
    off = VLLM_METRICS.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    assert off != VLLM_METRICS
    result = vllm({"version": "0.8.5"}, off)
    assert [d["id"] for d in result.evidence["defects"]] == [LOGITS_CVE, CONDENSE_CVE]
    assert result.evidence["unknown"] == []
    accepted = vllm({"version": "0.8.5"}, off, ignore=[LOGITS_CVE, CONDENSE_CVE])
    assert (accepted.verdict, accepted.reason) == (Verdict.PASS, "known_defect_accepted")


def test_a_prefix_caching_fact_the_node_does_not_publish_is_unknown() -> None:
    # The operator accepted the 2026 allowlist CVEs, which apply to 0.8.5 whatever it publishes.
    result = vllm({"version": "0.8.5"}, metrics=None, ignore=[LOGITS_CVE, CONDENSE_CVE])
    assert (result.verdict, result.reason) == (Verdict.ERROR, "fact_unknown")
    assert (
        f"{CACHE_SALT_CVE} (affected <0.9.0): the node does not publish enable_prefix_caching"
        in result.detail
    )
    assert "vllm:cache_config_info in /metrics" in result.detail
    assert [u["id"] for u in result.evidence["unknown"]] == [CACHE_SALT_CVE]  # 0.8.5 is past <0.7.2


def test_a_release_of_the_slot_advisorys_range_is_unknown_until_it_states_its_scheduling() -> None:
    result = vllm({"version": "0.20.1"})
    # The allowlist CVEs apply (a mismatch); the slot advisory needs what vLLM does not publish.
    assert [d["id"] for d in result.evidence["defects"]] == [LOGITS_CVE, CONDENSE_CVE]
    [unknown] = result.evidence["unknown"]
    assert unknown["id"] == SLOT_GHSA and "does not publish async_scheduling" in unknown["why"]
    accepted = vllm({"version": "0.20.1"}, ignore=[LOGITS_CVE, CONDENSE_CVE])
    assert (accepted.verdict, accepted.reason) == (Verdict.ERROR, "fact_unknown")
    assert f"{SLOT_GHSA} (affected >=0.16.0,<0.21.0)" in accepted.detail
    assert (
        vllm({"version": "0.21.0"}, ignore=[LOGITS_CVE, CONDENSE_CVE, FORCED_END_GHSA]).verdict
        is Verdict.PASS
    )


@pytest.mark.parametrize(
    ("version", "ids"),
    [
        ("0.21.0", [FORCED_END_GHSA, LOGITS_CVE, CONDENSE_CVE]),
        ("0.27.3", [FORCED_END_GHSA, LOGITS_CVE, CONDENSE_CVE]),
        ("0.28.0", [LOGITS_CVE, CONDENSE_CVE]),
        ("0.29.0", [CONDENSE_CVE]),
        ("0.31.0", []),
    ],
)
def test_the_2026_per_request_parameter_defects_end_at_their_fixed_releases(
    version: str, ids: list[str]
) -> None:
    result = vllm({"version": version})
    assert [d["id"] for d in result.evidence["defects"]] == ids
    assert result.verdict is (Verdict.MISMATCH if ids else Verdict.PASS)


def test_a_null_vllm_version_is_an_error_naming_get_version() -> None:
    result = vllm(fixture("vllm-broken-version-null.json"))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "version_unknown")
    assert result.detail.startswith(
        "vllm version not published: looked for GET /version at http://127.0.0.1:"
    )


# --- llama.cpp, hosted APIs, the reference worker -------------------------------------------------


def test_a_llamacpp_build_number_is_not_a_release() -> None:
    cfg = config("http://llama.test", "llamacpp")
    result = check(cfg, Seam({"/props": fixture("llamacpp-b1-0c1e570-props.json")}))
    assert (result.verdict, result.reason) == (Verdict.ERROR, "version_unknown")
    assert "'b1-0c1e570' is a llama.cpp build number and commit, not a release" in result.detail
    assert "`build_info` in /props" in result.detail


def test_a_hosted_api_publishes_no_version() -> None:
    seam = Seam({"/v1/models": fixture("sglang-0.5.11-v1-models.json")})
    result = check(config("http://api.test", "openai"), seam)
    assert (result.verdict, result.reason) == (Verdict.ERROR, "version_unknown")
    assert result.detail.startswith("openai version not published: looked for nowhere: hosted APIs")
    stated = check(config("http://api.test", "openai", version="1.0"), seam)
    assert (stated.verdict, stated.reason) == (Verdict.ERROR, "no_defect_data")


def test_the_reference_worker_passes_with_its_own_version(reference: Callable[..., Reference]) -> None:
    worker = reference("--mode", "aggregated", "--kv-pool-tokens", "4096", "--context-window", "2048")
    result = check(config(worker.url, "reference"))
    assert (result.verdict, result.reason) == (Verdict.PASS, "no_known_defect")
    assert result.detail == "no known defect for kvcanary-reference 0.1.0 (0 entries checked)"
    assert result.evidence["published_version"] == "kvcanary-reference 0.1.0"
