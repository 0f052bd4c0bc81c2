"""Every panel's PromQL runs on a real Prometheus: it parses, and on data shaped like the contracts it
returns series without a matching error.

Prometheus comes from the Debian package (``tests/support/services.py``). Without the binary these tests skip,
unless ``KVCANARY_REQUIRE_PROMETHEUS=1`` turns the skip into a failure (set it in CI).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvcanary.monitor.commands.dashboards import dashboard_files, load_dashboard, panel_queries, substitute
from tests.support.dashboards import RULE_FILES, variable_selector
from tests.support.services import Prometheus, start_prometheus, wait_for

pytestmark = pytest.mark.external_service


@pytest.fixture(scope="module", autouse=True)
def _needs_prometheus() -> None:
    if shutil.which("prometheus"):
        return
    reason = "the prometheus binary is missing (apt-get install prometheus)"
    if os.environ.get("KVCANARY_REQUIRE_PROMETHEUS", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"KVCANARY_REQUIRE_PROMETHEUS is set but {reason}", pytrace=False)
    pytest.skip(reason)


def variable_queries() -> list[tuple[str, str, str]]:
    """Return (dashboard uid, variable, selector) for every ``label_values`` variable, substituted."""
    found = []
    for path in dashboard_files():
        model = load_dashboard(path)
        for var in model["templating"]["list"]:
            if var["type"] == "query":
                found.append((model["uid"], var["name"], substitute(variable_selector(var["query"]))))
    return found


def test_every_panel_query_and_variable_selector_parses(tmp_path: Path) -> None:
    prometheus = start_prometheus(tmp_path / "prometheus", scrape={})
    try:
        queries = panel_queries() + variable_queries()
        assert len(queries) > 40
        for uid, title, expr in queries:
            assert "$" not in expr, (uid, title, expr)
            prometheus.query(expr)  # raises on any PromQL error
    finally:
        prometheus.stop()


# --- the same queries on data shaped like docs/monitor-metrics.md and docs/worker-metrics.md ------------


def monitor_metrics(n: int) -> str:
    """The monitor's /metrics after ``n`` scrapes: two targets, two probes, two nodes each."""
    now, lines = time.time(), []
    for target in ("healthy", "defective"):
        blind = 4 if target == "defective" else 0  # pairs of a prefill node without a bootstrap port
        lines += [
            f'kvcanary_node_kv_pool_tokens{{target="{target}",node="n0",pool="prefill"}} 4096',
            f'kvcanary_node_kv_pool_tokens{{target="{target}",node="n0",pool="decode"}} 16384',
            f'kvcanary_node_kv_pool_tokens{{target="{target}",node="n1",pool="unified"}} 32768',
            f'kvcanary_node_context_window_tokens{{target="{target}",node="n0"}} 8192',
            f'kvcanary_node_context_window_tokens{{target="{target}",node="n1"}} 8192',
            f'kvcanary_incidents_open{{target="{target}",probe="recall",node="",severity="critical"}} 1',
            f'kvcanary_incidents_open{{target="{target}",probe="recall",node="n0",severity="warning"}} 0',
            f'kvcanary_path_last_judged_timestamp{{target="{target}",prefill="p0",decode="d0"}} {now - 20}',
            f'kvcanary_path_last_judged_timestamp{{target="{target}",prefill="p0",decode="d1"}} {now - 200}',
            f'kvcanary_path_judge_interval_seconds{{target="{target}"}} 30',
            f'kvcanary_paths_unprobed{{target="{target}",reason="no_bootstrap_port"}} {blind}',
            f'kvcanary_paths_unprobed{{target="{target}",reason="over_max_paths"}} 0',
            f'kvcanary_node_last_judged_timestamp{{target="{target}",node="n0"}} {now - 40}',
            f'kvcanary_node_last_judged_timestamp{{target="{target}",node="n1"}} {now - 400}',
            f'kvcanary_node_judge_interval_seconds{{target="{target}"}} 60',
            f'kvcanary_gateway_node_changes_total{{target="{target}",change="joined"}} {2 + n // 10}',
            f'kvcanary_gateway_node_changes_total{{target="{target}",change="left"}} {n // 10}',
            f'kvcanary_target_quarantined{{target="{target}"}} {int(target == "defective")}',
            f'kvcanary_target_quarantine_observed{{target="{target}"}} 0',
        ]
        for probe in ("recall", "shared_prefix"):
            pair = f'target="{target}",probe="{probe}"'
            lines += [
                f'kvcanary_probe_runs_total{{{pair},verdict="{v}"}} {n}' for v in ("pass", "leak", "error")
            ]
            lines += [
                f'kvcanary_probe_runs_total{{{pair},verdict="mismatch"}} 0',
                f"kvcanary_probe_last_duration_seconds{{{pair}}} 0.4",
                f"kvcanary_probe_last_run_timestamp_seconds{{{pair}}} {now - 5}",
                f"kvcanary_probe_last_success_timestamp_seconds{{{pair}}} {now - 65}",
                f"kvcanary_probe_interval_seconds{{{pair}}} 30",
                f'kvcanary_probe_tokens_total{{{pair},kind="prompt"}} {300 * n}',
                f'kvcanary_probe_tokens_total{{{pair},kind="completion"}} {8 * n}',
            ]
    for probe in ("recall", "shared_prefix"):
        lines += [
            f'kvcanary_probe_duration_seconds_bucket{{probe="{probe}",le="0.5"}} {n}',
            f'kvcanary_probe_duration_seconds_bucket{{probe="{probe}",le="+Inf"}} {2 * n}',
            f'kvcanary_probe_duration_seconds_sum{{probe="{probe}"}} {n}',
            f'kvcanary_probe_duration_seconds_count{{probe="{probe}"}} {2 * n}',
        ]
    for check in ("marker", "tokens", "capacity", "overlap"):
        lines += [
            f'kvcanary_traffic_records_total{{target="defective",check="{check}",verdict="pass"}} {50 * n}',
            f'kvcanary_traffic_records_total{{target="defective",check="{check}",verdict="leak"}} {n}',
        ]
    lines += [
        f'kvcanary_traffic_refused_total{{target="defective",by="admission"}} {3 * n}',
        f'kvcanary_traffic_refused_total{{target="defective",by="quarantine"}} {n}',
        f'kvcanary_traffic_unmatched_records_total{{gateway="gw0"}} {n}',
        f'kvcanary_traffic_tap_dropped_records_total{{gateway="gw0"}} {2 * n}',
        "kvcanary_traffic_stream_lag_seconds 0.4",
        "kvcanary_traffic_stream_replicas 2",
        f'kvcanary_traffic_stream_records_total{{outcome="judged"}} {300 * n}',
        f'kvcanary_traffic_stream_records_total{{outcome="duplicate"}} {n}',
        f'kvcanary_traffic_stream_records_total{{outcome="misrouted"}} {n}',
        "kvcanary_traffic_stream_partitions 16",
        *(f'kvcanary_traffic_stream_partition_consuming{{partition="{p}"}} {int(p != 3)}' for p in range(16)),
        *(
            f'kvcanary_traffic_stream_bucket_anomalies{{kind="{k}"}} 0'
            for k in ("replicas_over_limit", "claims_without_heartbeat", "partitions_withheld")
        ),
        'kvcanary_cross_tenant_leaks_total{target="defective"} 1',
        f"kvcanary_incidents_open_read_timestamp_seconds {now - 1}",
        "kvcanary_database_up 1",
        "kvcanary_spool_results 0",
        'kvcanary_results_dropped_total{verdict="pass"} 0',
        f'kvcanary_alert_deliveries_total{{alertmanager="am0",outcome="accepted"}} {n}',
        'kvcanary_alert_deliveries_total{alertmanager="am0",outcome="failed"} 0',
        "kvcanary_alert_outbox_events 0",
        "kvcanary_alert_outbox_oldest_age_seconds 0",
    ]
    return "\n".join(lines) + "\n"


def worker_metrics(n: int, mode: str = "disaggregated") -> str:
    """A reference worker's /metrics after ``n`` scrapes."""
    pools = {"prefill": 4096, "decode": 16384} if mode == "disaggregated" else {"unified": 32768}
    lines = [
        f"kvcanary_kv_pages_allocated_total {40 * n}",
        f"kvcanary_kv_pages_reused_dirty_total {10 * n}",
        f"kvcanary_kv_ownership_checks_total {500 * n}",
        "kvcanary_kv_ownership_violations_total 0",
        f'kvcanary_admission_rejections_total{{reason="kv_capacity"}} {n}',
        'kvcanary_admission_rejections_total{reason="context_window"} 0',
        f"kvcanary_placeholder_substitutions_total {n}",
        f'kvcanary_requests_total{{code="200"}} {5 * n}',
        'kvcanary_requests_total{code="500"} 0',
        f'kvcanary_time_to_first_token_seconds_bucket{{le="0.01"}} {n}',
        f'kvcanary_time_to_first_token_seconds_bucket{{le="+Inf"}} {2 * n}',
        f"kvcanary_time_to_first_token_seconds_sum {n}",
        f"kvcanary_time_to_first_token_seconds_count {2 * n}",
        "kvcanary_context_window_tokens 8192",
        f"kvcanary_prefix_cache_queries_total {100 * n}",
        f"kvcanary_prefix_cache_hits_total {30 * n}",
        f'kvcanary_worker_info{{version="0.1.0",mode="{mode}",admission="placeholder",'
        'verify_ownership="true",zero_freed_pages="false",prefix_cache="shared"} 1',
    ]
    lines += [f'kvcanary_kv_pool_tokens{{pool="{p}"}} {tokens}' for p, tokens in pools.items()]
    lines += [f'kvcanary_kv_pages_free{{pool="{p}"}} {tokens // 16}' for p, tokens in pools.items()]
    return "\n".join(lines) + "\n"


def serve_metrics(body: Callable[[int], str]) -> ThreadingHTTPServer:
    """Serve ``body(n)`` as /metrics on a free loopback port, ``n`` counting the scrapes."""
    scrapes = iter(range(1, 1_000_000))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body(next(scrapes)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def prometheus_with_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    exporters = [
        serve_metrics(monitor_metrics),
        serve_metrics(worker_metrics),
        serve_metrics(lambda n: worker_metrics(n, mode="aggregated")),
    ]
    hosts = [f"127.0.0.1:{server.server_address[1]}" for server in exporters]
    # With the rules, as the stack runs them: a panel may read what they record (the SLOs' budgets).
    prometheus = start_prometheus(
        tmp_path_factory.mktemp("prometheus"), scrape={"kvcanary": hosts[:1], "worker": hosts[1:]},
        rule_files=RULE_FILES,
    )  # fmt: skip
    try:
        # Three scrapes of each, so that every rate() over 1m has samples to work with.
        wait_for(lambda: prometheus.query("min(count_over_time(up[1m])) >= 3"), 30, "three scrapes")
        wait_for(lambda: prometheus.query("slo:period_error_budget_remaining:ratio"), 30, "the SLO rules")
        yield prometheus
    finally:
        prometheus.stop()
        for server in exporters:
            server.shutdown()


@pytest.mark.parametrize(
    ("uid", "title", "expr"),
    [pytest.param(*query, id=f"{query[0]}:{query[1]}:{i}") for i, query in enumerate(panel_queries())],
)
def test_every_panel_query_returns_series_on_contract_shaped_data(
    prometheus_with_data: Prometheus, uid: str, title: str, expr: str
) -> None:
    assert prometheus_with_data.query(expr), f"{uid} / {title}: no series for {expr}"
