"""/metrics writes the per-pair series itself: it must say exactly what prometheus-client would."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.monitor.metrics.exposition import number
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.recording.spool import Spool
from kvcanary.probes.base import ProbeResult, Verdict

Sample = tuple[str, tuple[tuple[str, str], ...], float]


def samples(page: bytes) -> list[Sample]:
    out = []
    for family in text_string_to_metric_families(page.decode()):
        for s in family.samples:
            value = -1.0 if math.isnan(s.value) else s.value
            out.append((s.name, tuple(sorted(s.labels.items())), value))
    return sorted(out)


def families(page: bytes) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(page.decode())}


def populated() -> MonitorMetrics:
    metrics = MonitorMetrics(CollectorRegistry())
    odd = 'we"ird\\tar\nget'  # names are validated by the config; the writer must not rely on it
    pairs = [("a", "canary", ""), ("a", "capacity", "prefill-0"), (odd, "canary", "")]
    metrics.watch_incidents(lambda: [("a", "canary", "", "critical", "certain", 2)], lambda: pairs)
    metrics.watch_spool(Spool(None))
    metrics.watch_replicas(lambda: (3, 7))
    metrics.declare("a", {"canary": 30.0, "capacity": 60.0})
    metrics.declare(odd, {"canary": 1e-3})
    measured = {"prompt_tokens_spent": 123.0, "completion_tokens_spent": 9.0, "context_window_tokens": 8192.0}
    metrics.observe(
        "a", "canary", ProbeResult(verdict=Verdict.LEAK, reason="x", measurements=measured), 0.25, 1.8e9
    )
    metrics.observe("a", "canary", ProbeResult(verdict=Verdict.PASS, reason="ok"), 1e-7, 1.8e9 + 30)
    metrics.observe(odd, "canary", ProbeResult(verdict=Verdict.ERROR, reason="down"), math.inf, 1.8e9)
    metrics.observe("b", "late", ProbeResult(verdict=Verdict.MISMATCH, reason="x"), 3.0, 1.8e9)
    return metrics


def test_the_page_served_says_what_prometheus_client_would_say() -> None:
    metrics = populated()
    fast, reference = metrics.exposition(), generate_latest(metrics.registry)
    assert families(fast) == families(reference)
    read_at = "kvcanary_incidents_open_read_timestamp_seconds"  # read again at each scrape
    assert [s for s in samples(fast) if s[0] != read_at] == [s for s in samples(reference) if s[0] != read_at]


def test_it_holds_the_values_observed() -> None:
    page = {(n, labels): v for n, labels, v in samples(populated().exposition())}
    pair = (("probe", "canary"), ("target", "a"))
    assert page[("kvcanary_probe_runs_total", (*pair[:1], pair[1], ("verdict", "leak")))] == 1
    assert page[("kvcanary_probe_tokens_total", (("kind", "prompt"), *pair))] == 123
    assert page[("kvcanary_probe_last_success_timestamp_seconds", pair)] == 1.8e9 + 30
    assert page[("kvcanary_probe_last_duration_seconds", pair)] == 1e-7
    assert page[("kvcanary_cross_tenant_leaks_total", (("target", "a"),))] == 1
    assert (
        page[("kvcanary_probe_runs_total", (("probe", "late"), ("target", "b"), ("verdict", "mismatch")))]
        == 1
    )
    open_ = (
        ("certainty", "certain"),
        ("node", ""),
        ("probe", "canary"),
        ("severity", "critical"),
        ("target", "a"),
    )
    assert page[("kvcanary_incidents_open", open_)] == 2
    assert page[("kvcanary_probe_duration_seconds_count", (("probe", "canary"),))] == 3


def test_numbers_are_written_as_prometheus_reads_them() -> None:
    assert [number(v) for v in (1.0, 0.1, math.inf, -math.inf)] == ["1.0", "0.1", "+Inf", "-Inf"]
    assert number(math.nan) == "NaN"
    assert float(number(1796063315.1344347)) == 1796063315.1344347
    assert number(1.8e9) == "1.8e+09"


def test_the_lines_are_those_prometheus_client_writes() -> None:
    """Byte for byte, bar the read timestamp: label names in order, counters named with _total."""
    metrics = populated()
    read_at = "kvcanary_incidents_open_read_timestamp_seconds "

    def lines(page: bytes) -> set[str]:
        return {line for line in page.decode().splitlines() if not line.startswith(read_at)}

    assert lines(metrics.exposition()) == lines(generate_latest(metrics.registry))
