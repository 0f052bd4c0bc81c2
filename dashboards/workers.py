"""The workers dashboard (uid ``kvcanary-workers``): the reference workers' own counters.

Every metric here is the worker's (docs/worker-metrics.md), scraped by Prometheus straight from
each worker's ``/metrics``, so series carry Prometheus's ``job`` and ``instance`` labels and no
``target``. Variables: ``job`` and ``instance``.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from kvcanary.dashboards.panels import (
    BLUE,
    GREEN,
    ORANGE,
    RED,
    YELLOW,
    Grid,
    Query,
    label_variable,
    standard_dashboard,
    stat_panel,
    table_panel,
    timeseries_panel,
)

UID = "kvcanary-workers"
W = 'job=~"$job", instance=~"$instance"'
INFO_LABELS = "version, mode, admission, verify_ownership, zero_freed_pages, prefix_cache"


def per_instance_rate(metric: str, by: str = "job, instance", window: str = "$__rate_interval") -> str:
    return f"sum by ({by}) (rate({metric}{{{W}}}[{window}]))"


def total_in_range(metric: str) -> str:
    return f"round(sum(increase({metric}{{{W}}}[$__range])))"


def build() -> Dashboard:
    """Return the workers dashboard."""
    dashboard = (
        standard_dashboard(
            UID,
            "kvcanary / Workers",
            "The reference workers' own counters: ownership checks, dirty page reuse, admission, "
            "KV pools, requests, time to first token and the prefix cache.",
        )
        .with_variable(
            label_variable(
                "job", "Job", "label_values(kvcanary_context_window_tokens, job)",
                "Prometheus scrape jobs that scrape reference workers.",
            )
        )
        .with_variable(
            label_variable(
                "instance", "Instance", 'label_values(kvcanary_context_window_tokens{job=~"$job"}, instance)',
                "Worker processes (host:port).",
            )
        )
    )  # fmt: skip
    grid = Grid(dashboard)
    _isolation(grid)
    _isolation_trends(grid)
    _admission(grid)
    _capacity(grid)
    _latency(grid)
    return grid.dashboard


def _isolation(grid: Grid) -> None:
    grid.row("Isolation")
    grid.add(
        stat_panel(
            "Ownership violations",
            "Requests refused in the selected range because a page they would read was not theirs "
            "(`--verify-ownership`). Any is an isolation failure caught in time.",
            [Query(total_in_range("kvcanary_kv_ownership_violations_total"), instant=True)],
            steps=((GREEN, None), (RED, 1.0)),
        ),
        w=6, h=4,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Placeholder substitutions",
            "Over-capacity requests replaced by the one-token placeholder in the selected range: "
            "the disclosed defect. Any is a leak in progress.",
            [Query(total_in_range("kvcanary_placeholder_substitutions_total"), instant=True)],
            steps=((GREEN, None), (RED, 1.0)),
        ),
        w=6, h=4,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Ownership checks",
            "Block-table entries checked in the selected range. 0 (orange) means no worker runs "
            "with `--verify-ownership`, so foreign pages would go unnoticed.",
            [Query(total_in_range("kvcanary_kv_ownership_checks_total"), instant=True)],
            steps=((ORANGE, None), (GREEN, 1.0)),
        ),
        w=6, h=4,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Dirty pages among allocations",
            "Share of allocated pages that still held another request's K/V in the selected range. "
            "The exposure, not a leak by itself; 0 with `--zero-freed-pages`.",
            [
                Query(
                    f"sum(increase(kvcanary_kv_pages_reused_dirty_total{{{W}}}[$__range])) "
                    f"/ sum(increase(kvcanary_kv_pages_allocated_total{{{W}}}[$__range]))",
                    instant=True,
                )
            ],
            "percentunit",
            steps=((BLUE, None),),
            decimals=1,
        ),
        w=6, h=4,
    )  # fmt: skip


def _isolation_trends(grid: Grid) -> None:
    grid.add(
        timeseries_panel(
            "Ownership checks and violations",
            "Entries checked per second (left) and requests refused for a foreign or unwritten page "
            "per minute (right, red).",
            [
                Query(per_instance_rate("kvcanary_kv_ownership_checks_total"), "{{instance}} checks/s"),
                Query(
                    per_instance_rate("kvcanary_kv_ownership_violations_total") + " * 60",
                    "{{instance}} violations/min",
                ),
            ],
            "ops",
            colors={".*violations.*": RED},
        ),
        w=12, h=8,
    )  # fmt: skip
    dirty = per_instance_rate("kvcanary_kv_pages_reused_dirty_total")
    info = f"max by (job, instance, zero_freed_pages) (kvcanary_worker_info{{{W}}})"
    grid.add(
        timeseries_panel(
            "Dirty page reuse",
            "Pages per second handed out while still holding another request's K/V, labelled with the "
            "worker's `zero_freed_pages` setting, beside all allocations (dashed). Non-zero without "
            "`--zero-freed-pages`; a worker without `kvcanary_worker_info` shows an empty setting.",
            [
                Query(
                    f"({dirty} * on (job, instance) group_left (zero_freed_pages) {info}) "
                    f"or on (job, instance) {dirty}",
                    "{{instance}} dirty (zero_freed_pages={{zero_freed_pages}})",
                ),
                Query(per_instance_rate("kvcanary_kv_pages_allocated_total"), "{{instance}} allocated"),
            ],
            "ops",
            colors={".*dirty.*": ORANGE},
        ),
        w=12, h=8,
    )  # fmt: skip
    grid.add(
        table_panel(
            "Worker configuration",
            "What each worker runs with, from `kvcanary_worker_info`.",
            [Query(f"max by (job, instance, {INFO_LABELS}) (kvcanary_worker_info{{{W}}})", table=True)],
            hide=("Time", "Value"),
        ),
        w=24, h=5,
    )  # fmt: skip


def _admission(grid: Grid) -> None:
    grid.row("Admission and requests")
    grid.add(
        timeseries_panel(
            "Admission rejections and placeholder substitutions",
            "Requests refused per minute before any KV was computed, by reason, and over-capacity "
            "requests replaced by the placeholder (red: the defect). With a context window larger "
            "than the pool, a fixed engine shows `kv_capacity` where a defective one substitutes.",
            [
                Query(
                    per_instance_rate("kvcanary_admission_rejections_total", "job, instance, reason")
                    + " * 60",
                    "{{instance}} rejected: {{reason}}",
                ),
                Query(
                    per_instance_rate("kvcanary_placeholder_substitutions_total") + " * 60",
                    "{{instance}} placeholder substituted",
                ),
            ],
            "opm",
            colors={".*placeholder.*": RED, ".*kv_capacity": ORANGE, ".*context_window": YELLOW},
        ),
        w=12, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Requests by code",
            "Answers of the completion endpoints per second, by HTTP status. 500 includes "
            "`kv_ownership_violation` refusals.",
            [Query(per_instance_rate("kvcanary_requests_total", "code"), "{{code}}")],
            "reqps",
            stack=True,
            colors={"5..": RED, "4..": ORANGE, "2..": GREEN},
        ),
        w=12, h=8,
    )  # fmt: skip


def _capacity(grid: Grid) -> None:
    grid.row("KV capacity")
    grid.add(
        stat_panel(
            "KV pool ÷ context window",
            "Per worker: the pool admission checks (unified or prefill) divided by the advertised "
            "context window. Below 1 (red) a prompt can fit the context window but not the pool: "
            "the incident's misconfiguration. Below 2: a warning.",
            [
                Query(
                    f"min by (job, instance) "
                    f'(kvcanary_kv_pool_tokens{{{W}, pool=~"unified|single|prefill"}}) '
                    f"/ on (job, instance) max by (job, instance) (kvcanary_context_window_tokens{{{W}}})",
                    "{{instance}}",
                    instant=True,
                )
            ],
            "none",
            steps=((RED, None), (ORANGE, 1.0), (GREEN, 2.0)),
            decimals=2,
        ),
        w=6, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "KV pool vs context window",
            "Usable capacity of each pool and the advertised context window, in tokens.",
            [
                Query(
                    f"max by (instance, pool) (kvcanary_kv_pool_tokens{{{W}}})",
                    "{{instance}} pool {{pool}}",
                ),
                Query(
                    f"max by (instance) (kvcanary_context_window_tokens{{{W}}})",
                    "{{instance}} context window",
                ),
            ],
            colors={".*context window": RED},
        ),
        w=9, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Free KV pages per pool",
            "Pages free right now in each pool.",
            [Query(f"sum by (instance, pool) (kvcanary_kv_pages_free{{{W}}})", "{{instance}} {{pool}}")],
        ),
        w=9, h=8,
    )  # fmt: skip


def _latency(grid: Grid) -> None:
    grid.row("Latency and prefix cache")
    grid.add(
        timeseries_panel(
            "Time to first token",
            "p50, p90 and p99 from submission to the first generated token, queueing included. A "
            "near-zero TTFT for a huge prompt is the placeholder defect's signature.",
            [
                Query(
                    f"histogram_quantile({q}, sum by (instance, le) "
                    f"(rate(kvcanary_time_to_first_token_seconds_bucket{{{W}}}[$__rate_interval])))",
                    f"p{round(q * 100)} {{{{instance}}}}",
                )
                for q in (0.5, 0.9, 0.99)
            ],
            "s",
        ),
        w=12, h=8,
    )  # fmt: skip
    ratio = (
        f"{per_instance_rate('kvcanary_prefix_cache_hits_total')} "
        f"/ {per_instance_rate('kvcanary_prefix_cache_queries_total')}"
    )
    info = f"max by (job, instance, prefix_cache) (kvcanary_worker_info{{{W}}})"
    grid.add(
        timeseries_panel(
            "Prefix cache hit ratio",
            "Prompt tokens served from the prefix cache divided by those looked up, per worker, "
            "labelled with its `prefix_cache` setting (no line while the cache is off). A hit is "
            "only safe within a tenant: the cross-tenant probes check that none crosses tenants.",
            [
                Query(
                    f"({ratio}) * on (job, instance) group_left (prefix_cache) {info} "
                    f"or on (job, instance) ({ratio})",
                    "{{instance}} (prefix_cache={{prefix_cache}})",
                )
            ],
            "percentunit",
            max_val=1,
        ),
        w=12, h=8,
    )  # fmt: skip
