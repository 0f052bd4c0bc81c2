"""/metrics: the documented contract (docs/worker-metrics.md) parses, starts at zero and moves."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.workers import __version__
from kvcanary.workers.metrics import WorkerMetrics
from tests.workers.support import complete

CONTRACT = {
    "kvcanary_kv_pages_allocated": ("counter", set()),
    "kvcanary_kv_pages_reused_dirty": ("counter", set()),
    "kvcanary_kv_ownership_checks": ("counter", set()),
    "kvcanary_kv_ownership_violations": ("counter", set()),
    "kvcanary_admission_rejections": ("counter", {"reason"}),
    "kvcanary_placeholder_substitutions": ("counter", set()),
    "kvcanary_requests": ("counter", {"code"}),
    "kvcanary_time_to_first_token_seconds": ("histogram", set()),
    "kvcanary_kv_pool_tokens": ("gauge", {"pool"}),
    "kvcanary_kv_pages_free": ("gauge", {"pool"}),
    "kvcanary_context_window_tokens": ("gauge", set()),
    "kvcanary_prefix_cache_queries": ("counter", set()),
    "kvcanary_prefix_cache_hits": ("counter", set()),
    "kvcanary_kv_transfer_checksum_failures": ("counter", set()),
    "kvcanary_worker_info": (
        "gauge",
        {"version", "mode", "admission", "verify_ownership", "zero_freed_pages", "prefix_cache"},
    ),
}


def families(client: TestClient) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}


def value(client: TestClient, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not exported")


def test_it_exports_the_documented_metrics_with_their_types_and_labels(
    serve: Callable[..., TestClient],
) -> None:
    found = families(serve(mode="disaggregated"))
    for name, (kind, labels) in CONTRACT.items():
        family = found[name]
        assert family.type == kind, name  # type: ignore[attr-defined]
        sample_labels = {k for s in family.samples for k in s.labels if k != "le"}  # type: ignore[attr-defined]
        assert sample_labels == labels, name


def test_it_starts_known_label_values_at_zero(serve: Callable[..., TestClient]) -> None:
    client = serve(mode="disaggregated")
    for reason in ("context_window", "kv_capacity"):
        assert value(client, "kvcanary_admission_rejections_total", reason=reason) == 0
    for code in ("200", "400", "401", "404", "500"):
        assert value(client, "kvcanary_requests_total", code=code) == 0
    assert value(client, "kvcanary_kv_pool_tokens", pool="prefill") == 1024
    assert value(client, "kvcanary_kv_pool_tokens", pool="decode") == 4096
    assert value(client, "kvcanary_kv_pages_free", pool="decode") == 256
    assert value(client, "kvcanary_context_window_tokens") == 8192
    assert value(client, "kvcanary_prefix_cache_queries_total") == 0
    assert value(client, "kvcanary_prefix_cache_hits_total") == 0


def test_it_counts_cached_tokens_by_the_tier_that_served_them(serve: Callable[..., TestClient]) -> None:
    prefix = serve(prefix_cache="shared")
    assert value(prefix, "kvcanary_cached_tokens_by_tier_total", tier="prefix") == 0
    complete(prefix, "p" * 100, max_tokens=1)
    hit = complete(prefix, "p" * 100, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit == 96 and value(prefix, "kvcanary_cached_tokens_by_tier_total", tier="prefix") == hit

    sessions = serve(session_cache=2)
    tiers = ("session", "offload")
    assert [value(sessions, "kvcanary_cached_tokens_by_tier_total", tier=t) for t in tiers] == [0, 0]
    complete(sessions, "s" * 100, max_tokens=1)
    complete(sessions, "s" * 100, max_tokens=1)  # the ring holds it
    for other in "xyz":  # the ring (2 slots) moves on; the offload tier keeps it
        complete(sessions, other * 100, max_tokens=1)
    complete(sessions, "s" * 100, max_tokens=1)
    assert [value(sessions, "kvcanary_cached_tokens_by_tier_total", tier=t) for t in tiers] == [96, 96]


def test_it_counts_requests_pages_and_first_tokens(serve: Callable[..., TestClient]) -> None:
    client = serve()
    complete(client, "x" * 40, max_tokens=8)
    complete(client, "y" * 9000)
    complete(client, "z", model="nope")
    assert value(client, "kvcanary_requests_total", code="200") == 1
    assert value(client, "kvcanary_requests_total", code="400") == 1
    assert value(client, "kvcanary_requests_total", code="404") == 1
    assert value(client, "kvcanary_admission_rejections_total", reason="context_window") == 1
    assert value(client, "kvcanary_kv_pages_allocated_total") == 3  # 40 prompt + 8 new tokens = 3 pages
    assert value(client, "kvcanary_time_to_first_token_seconds_count") == 1
    assert value(client, "kvcanary_kv_ownership_checks_total") == 0  # verification is off


def test_it_uses_its_own_registry() -> None:
    first, second = WorkerMetrics(), WorkerMetrics()
    first.placeholder_substitutions.inc()
    assert b"kvcanary_placeholder_substitutions_total 0.0" in second.render()


def test_it_describes_the_settings_in_force_in_worker_info(serve: Callable[..., TestClient]) -> None:
    client = serve(mode="aggregated", admission="placeholder", verify_ownership=True, prefix_cache="shared")
    info = {
        "version": __version__,
        "mode": "aggregated",
        "admission": "reject",  # aggregated mode rejects whatever --admission says
        "verify_ownership": "true",
        "zero_freed_pages": "false",
        "prefix_cache": "shared",
    }
    assert value(client, "kvcanary_worker_info", **info) == 1
    client = serve(mode="disaggregated", admission="placeholder", zero_freed_pages=True)
    info.update(mode="disaggregated", admission="placeholder", verify_ownership="false")
    info.update(zero_freed_pages="true", prefix_cache="off")
    assert value(client, "kvcanary_worker_info", **info) == 1


def test_it_counts_prefix_cache_lookups_and_hits_in_prompt_tokens(serve: Callable[..., TestClient]) -> None:
    client = serve(prefix_cache="per-tenant")
    for key in ("alice", "alice", "bob"):
        complete(client, "q" * 100, key=key, max_tokens=4)
    assert value(client, "kvcanary_prefix_cache_queries_total") == 300
    assert value(client, "kvcanary_prefix_cache_hits_total") == 96  # alice's second: six whole pages
    off = serve()
    complete(off, "q" * 100, max_tokens=4)
    complete(off, "q" * 100, max_tokens=4)
    assert value(off, "kvcanary_prefix_cache_queries_total") == 0
    assert value(off, "kvcanary_prefix_cache_hits_total") == 0


def test_it_counts_no_cache_hit_as_an_allocation_or_a_dirty_reuse(serve: Callable[..., TestClient]) -> None:
    client = serve(prefix_cache="shared")
    complete(client, "d" * 100, max_tokens=16, key="alice")  # 116 tokens: 8 pages, six published
    assert value(client, "kvcanary_kv_pages_allocated_total") == 8
    assert value(client, "kvcanary_kv_pages_reused_dirty_total") == 0
    complete(client, "d" * 100, max_tokens=16, key="bob")  # six pages hit, two taken fresh
    assert value(client, "kvcanary_kv_pages_allocated_total") == 8 + 2
    # The two fresh pages are the two alice freed (LIFO), still holding her K/V: dirty. The hits not.
    assert value(client, "kvcanary_kv_pages_reused_dirty_total") == 2
