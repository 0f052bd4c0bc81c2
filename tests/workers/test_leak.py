"""The disclosed leak, its fix and owner-verified pages, through HTTP (in-process).

Tenant A completes a 600-byte prompt carrying a canary; tenant B then sends a 1500-token prompt,
inside the 8192-token context window but over the 1024-token prefill pool, with ``max_tokens=200``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.workers.support import CANARY, OVER_CAPACITY_PROMPT, PROMPT_A, complete, four_grams

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Return every sample of /metrics keyed by (name, sorted labels)."""
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def tenant_a_then_b(client: TestClient) -> Any:
    """Run the scenario; return B's response."""
    a = complete(client, PROMPT_A, key="sk-a")
    assert a.status_code == 200 and a.json()["choices"][0]["text"] == PROMPT_A[:16]
    return complete(client, OVER_CAPACITY_PROMPT, key="sk-b", max_tokens=200)


def test_it_leaks_tenant_a_text_to_tenant_b_with_placeholder_admission(
    serve: Callable[..., TestClient],
) -> None:
    client = serve(mode="disaggregated", admission="placeholder", api_keys=KEYS)
    b = tenant_a_then_b(client)
    assert b.status_code == 200
    body = b.json()
    assert CANARY in body["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == 1
    metrics = scrape(client)
    assert metrics[("kvcanary_placeholder_substitutions_total", ())] == 1
    assert metrics[("kvcanary_kv_pages_reused_dirty_total", ())] > 0


def test_it_rejects_the_over_capacity_request_before_any_transfer_when_fixed(
    serve: Callable[..., TestClient],
) -> None:
    client = serve(mode="disaggregated", admission="reject", api_keys=KEYS)
    b = tenant_a_then_b(client)
    assert b.status_code == 400
    assert "exceeds the maximum allowed length (1023 tokens)" in b.json()["error"]["message"]
    metrics = scrape(client)
    assert metrics[("kvcanary_admission_rejections_total", (("reason", "kv_capacity"),))] == 1
    assert metrics[("kvcanary_placeholder_substitutions_total", ())] == 0
    assert metrics[("kvcanary_requests_total", (("code", "400"),))] == 1


def test_it_rejects_the_same_request_on_an_aggregated_node(serve: Callable[..., TestClient]) -> None:
    client = serve(mode="aggregated", admission="placeholder", kv_pool_tokens=1024, api_keys=KEYS)
    assert tenant_a_then_b(client).status_code == 400


def test_it_fails_closed_without_content_when_ownership_is_verified(serve: Callable[..., TestClient]) -> None:
    client = serve(mode="disaggregated", admission="placeholder", verify_ownership=True, api_keys=KEYS)
    b = tenant_a_then_b(client)
    assert b.status_code == 500
    assert b.json() == {
        "error": {"message": "KV page ownership check failed", "type": "kv_ownership_violation", "code": 500}
    }
    assert CANARY not in b.text
    metrics = scrape(client)
    assert metrics[("kvcanary_kv_ownership_violations_total", ())] == 1
    assert metrics[("kvcanary_kv_ownership_checks_total", ())] > 0
    assert metrics[("kvcanary_requests_total", (("code", "500"),))] == 1


def test_it_fails_a_stream_closed_before_its_first_token(serve: Callable[..., TestClient]) -> None:
    client = serve(mode="disaggregated", admission="placeholder", verify_ownership=True, api_keys=KEYS)
    complete(client, PROMPT_A, key="sk-a")
    b = complete(client, OVER_CAPACITY_PROMPT, key="sk-b", max_tokens=200, stream=True)
    assert b.status_code == 500
    assert b.headers["content-type"] == "application/json"
    assert b.json()["error"]["type"] == "kv_ownership_violation"


def test_it_leaks_nothing_of_tenant_a_when_freed_pages_are_zeroed(serve: Callable[..., TestClient]) -> None:
    client = serve(mode="disaggregated", admission="placeholder", zero_freed_pages=True, api_keys=KEYS)
    b = tenant_a_then_b(client)
    text = b.json()["choices"][0]["text"] if b.status_code == 200 else b.text
    assert CANARY not in text
    assert four_grams(text) & four_grams(PROMPT_A) == set()
    assert scrape(client)[("kvcanary_kv_pages_reused_dirty_total", ())] == 0


def test_it_serves_healthy_traffic_unchanged_with_verification_on(serve: Callable[..., TestClient]) -> None:
    client = serve(mode="disaggregated", admission="reject", verify_ownership=True)
    for prompt in (PROMPT_A[:150], "short one", PROMPT_A[::-1][:150]):
        body = complete(client, prompt, max_tokens=1000).json()
        assert body["choices"][0]["text"] == prompt
    assert scrape(client)[("kvcanary_kv_ownership_violations_total", ())] == 0
