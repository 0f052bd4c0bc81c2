"""The overview dashboard (uid ``kvcanary-overview``): what the monitor judged, and whether it is healthy.

Every metric here is the monitor's own (docs/monitor-metrics.md). Variables: ``target`` and
``probe`` narrow every probe panel, ``node`` the per-node ones; the monitor's health panels are
not per target and ignore them.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from kvcanary.dashboards.containment import containment_row
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
from kvcanary.dashboards.traffic import traffic_row

UID = "kvcanary-overview"
PAIR = 'target=~"$target", probe=~"$probe"'
NODE = 'target=~"$target", node=~"$node"'
INCIDENTS = f'{PAIR}, node=~"$node"'
VERDICT_COLORS = {".*leak.*": RED, ".*mismatch.*": ORANGE, ".*error.*": YELLOW, ".*pass.*": GREEN}
HEADROOM_STEPS = ((RED, None), (ORANGE, 1.0), (GREEN, 2.0))


def runs(verdict: str, window: str) -> str:
    return f'kvcanary_probe_runs_total{{verdict="{verdict}", {PAIR}}}[{window}]'


def build() -> Dashboard:
    """Return the overview dashboard."""
    dashboard = (
        standard_dashboard(
            UID,
            "kvcanary / Overview",
            "KV-cache isolation verdicts per target and probe, open incidents, probe cost, "
            "capacity headroom per node, and the monitor's own health.",
        )
        .with_variable(
            label_variable(
                "target", "Target", "label_values(kvcanary_probe_runs_total, target)",
                "Serving targets from the monitor's config.",
            )
        )
        .with_variable(
            label_variable(
                "probe", "Probe", 'label_values(kvcanary_probe_runs_total{target=~"$target"}, probe)',
                "Probe modules run against the selected targets.",
            )
        )
        .with_variable(
            label_variable(
                "node", "Node", 'label_values(kvcanary_node_context_window_tokens{target=~"$target"}, node)',
                "Nodes the audits reported; narrows the capacity and incident panels.",
            )
        )
    )  # fmt: skip
    grid = Grid(dashboard)
    _verdicts(grid)
    _verdict_trends(grid)
    _budgets(grid)
    _incidents(grid)
    _cost(grid)
    _capacity(grid)
    containment_row(grid)
    traffic_row(grid)
    _health(grid)
    _health_trends(grid)
    _freshness(grid)
    return grid.dashboard


def _verdicts(grid: Grid) -> None:
    grid.row("Verdicts")
    for verdict, color, meaning in (
        ("leak", RED, "another tenant's marker came back, or a worker caught a foreign page"),
        ("mismatch", ORANGE, "a wrong answer, or a success where a refusal was due"),
        ("error", YELLOW, "the probe could not judge (never counted as a leak)"),
    ):
        grid.add(
            stat_panel(
                f"{verdict.capitalize()} verdicts",
                f"Probe runs judged `{verdict}` in the selected time range: {meaning}.",
                [Query(f"round(sum(increase({runs(verdict, '$__range')})))", instant=True)],
                steps=((GREEN, None), (color, 1.0)),
            ),
            w=6, h=4,
        )  # fmt: skip
    grid.add(
        stat_panel(
            "Open incidents",
            "Incidents open now for the selected targets and probes (read from the database).",
            [Query(f"sum(kvcanary_incidents_open{{{INCIDENTS}}})", instant=True)],
            steps=((GREEN, None), (RED, 1.0)),
        ),
        w=6, h=4,
    )  # fmt: skip


def _verdict_trends(grid: Grid) -> None:
    grid.add(
        timeseries_panel(
            "Verdicts per target and probe",
            "Probe runs per minute, stacked by verdict. Any `leak` is an isolation failure; "
            "`mismatch` is a wrong answer; `error` means the probe could not judge.",
            [
                Query(
                    f"sum by (target, probe, verdict) (rate(kvcanary_probe_runs_total{{{PAIR}}}"
                    "[$__rate_interval])) * 60",
                    "{{target}} / {{probe}}: {{verdict}}",
                )
            ],
            "opm",
            stack=True,
            colors=VERDICT_COLORS,
        ),
        w=16, h=9,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Leaks over time",
            "Probe runs judged `leak` in each interval, per target and probe. Each bar is an "
            "isolation failure the monitor saw; see the incident and its evidence in the API.",
            [
                Query(
                    f"sum by (target, probe) (increase({runs('leak', '$__rate_interval')}))",
                    "{{target}} / {{probe}}",
                )
            ],
            bars=True,
            colors={".*": RED},
        ),
        w=8, h=9,
    )  # fmt: skip


def _budgets(grid: Grid) -> None:
    grid.row("Error budgets")
    grid.add(
        stat_panel(
            "Error budget left (30 days)",
            "Per target and SLO, the share of the 30-day error budget not yet spent, as the SLO rules "
            "record it (alerts/kvcanary.slo.rules.yml, Sloth's slo:period_error_budget_remaining:ratio). "
            "correctness: 99.9% of judged probe runs pass (errors left out); coverage: 99% of path and "
            "node time judged within 3 intervals. Below 0 the objective is missed this period. A leak "
            "pages on its own whatever this says. No data: the SLO rules are not loaded.",
            [
                Query(
                    'slo:period_error_budget_remaining:ratio{sloth_service="kvcanary", target=~"$target"}',
                    "{{target}}: {{sloth_slo}}",
                    instant=True,
                )
            ],
            "percentunit",
            steps=((RED, None), (ORANGE, 0.0), (YELLOW, 0.25), (GREEN, 0.5)),
            decimals=1,
        ),
        w=24, h=5,
    )  # fmt: skip


def _incidents(grid: Grid) -> None:
    grid.row("Incidents")
    grid.add(
        stat_panel(
            "Open incidents by severity",
            "Incidents open now, by severity (critical, high, warning).",
            [
                Query(
                    f"sum by (severity) (kvcanary_incidents_open{{{INCIDENTS}}})",
                    "{{severity}}",
                    instant=True,
                )
            ],
            steps=((GREEN, None), (RED, 1.0)),
        ),
        w=8, h=6,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Open incidents over time",
            "Open incidents by target and severity.",
            [
                Query(
                    f"sum by (target, severity) (kvcanary_incidents_open{{{INCIDENTS}}})",
                    "{{target}}: {{severity}}",
                )
            ],
            stack=True,
            colors={".*critical": RED, ".*high": ORANGE, ".*warning": YELLOW},
        ),
        w=16, h=6,
    )  # fmt: skip
    grid.add(
        table_panel(
            "Open incidents by target, probe and node",
            "Every (target, probe, node, severity) with an open incident. `node` is empty for probes "
            "that judge the whole target; picking a node hides them.",
            [
                Query(
                    "sum by (target, probe, node, severity) "
                    f"(kvcanary_incidents_open{{{INCIDENTS}}}) > 0",
                    table=True,
                )
            ],
            rename={"Value": "open"},
        ),
        w=24, h=6,
    )  # fmt: skip


def _cost(grid: Grid) -> None:
    grid.row("Probe latency and cost")
    grid.add(
        timeseries_panel(
            "Probe duration by kind",
            "Wall time of one probe run, p50, p90 and p99 per probe kind (the histogram has no "
            "target label: at thousands of targets one would be tens of thousands of series).",
            [
                Query(
                    f"histogram_quantile({q}, sum by (probe, le) "
                    f'(rate(kvcanary_probe_duration_seconds_bucket{{probe=~"$probe"}}[$__rate_interval])))',
                    f"p{round(q * 100)} {{{{probe}}}}",
                )
                for q in (0.5, 0.9, 0.99)
            ],
            "s",
        ),
        w=5, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Slowest probe runs",
            "The ten (target, probe) pairs whose last run took longest.",
            [Query(f"topk(10, kvcanary_probe_last_duration_seconds{{{PAIR}}})", "{{target}} / {{probe}}")],
            "s",
        ),
        w=5, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Tokens spent on probing",
            "Tokens per minute the probes spent, as the engines reported them in `usage`: the "
            "cost of monitoring, by target and kind (prompt, completion).",
            [
                Query(
                    "sum by (target, kind) "
                    f"(rate(kvcanary_probe_tokens_total{{{PAIR}}}[$__rate_interval])) * 60",
                    "{{target}}: {{kind}}",
                )
            ],
            "suffix: tokens/min",
            stack=True,
        ),
        w=10, h=8,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Tokens spent",
            "Tokens the probes spent in the selected time range.",
            [Query(f"round(sum(increase(kvcanary_probe_tokens_total{{{PAIR}}}[$__range])))", instant=True)],
            steps=((BLUE, None),),
        ),
        w=4, h=8,
    )  # fmt: skip


def _capacity(grid: Grid) -> None:
    grid.row("Capacity headroom")
    headroom = (
        f'min by (target, node) (kvcanary_node_kv_pool_tokens{{{NODE}, pool!="decode"}}) '
        f"/ on (target, node) max by (target, node) (kvcanary_node_context_window_tokens{{{NODE}}})"
    )
    grid.add(
        stat_panel(
            "KV pool ÷ context window",
            "Per node: the smallest KV pool that admission checks (decode pools excluded) divided by "
            "the advertised context window, at the last audit. Below 1 (red) a prompt can fit the "
            "context window but not the pool: the incident's misconfiguration. Below 2: a warning.",
            [Query(headroom, "{{target}} / {{node}}", instant=True)],
            "none",
            steps=HEADROOM_STEPS,
            decimals=2,
        ),
        w=10, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "KV pool and context window",
            "Pool capacity per node and pool, and the context window the node advertised (tokens).",
            [
                Query(
                    f"max by (target, node, pool) (kvcanary_node_kv_pool_tokens{{{NODE}}})",
                    "{{target}} / {{node}}: pool {{pool}}",
                ),
                Query(
                    f"max by (target, node) (kvcanary_node_context_window_tokens{{{NODE}}})",
                    "{{target}} / {{node}}: context window",
                ),
            ],
            "short",
        ),
        w=14, h=8,
    )  # fmt: skip


def _health(grid: Grid) -> None:
    grid.row("Monitor health")
    small = [
        ("Database", "1 when the database answered the monitor's last scrape.",
         "min(kvcanary_database_up)", "none", ((RED, None), (GREEN, 1.0)),
         {"0": ("down", RED), "1": ("up", GREEN)}),
        ("Spool backlog", "Results waiting in the local spool for the database to come back.",
         "sum(kvcanary_spool_results)", "short", ((GREEN, None), (ORANGE, 1.0)), None),
        ("Results dropped", "Results lost in the selected range (spool full, or refused twice): data loss.",
         "round(sum(increase(kvcanary_results_dropped_total[$__range])))", "short",
         ((GREEN, None), (RED, 1.0)), None),
        ("Alert outbox backlog", "Incident events not yet delivered to any Alertmanager.",
         "sum(kvcanary_alert_outbox_events)", "short", ((GREEN, None), (ORANGE, 1.0)), None),
        ("Oldest undelivered alert", "Age of the oldest incident event still waiting for an Alertmanager.",
         "max(kvcanary_alert_outbox_oldest_age_seconds)", "s",
         ((GREEN, None), (ORANGE, 60.0), (RED, 300.0)), None),
        ("Incident counts age", "Time since the open-incident counts were read from the database.",
         "time() - max(kvcanary_incidents_open_read_timestamp_seconds)", "s",
         ((GREEN, None), (ORANGE, 120.0), (RED, 600.0)), None),
    ]  # fmt: skip
    for title, description, expr, unit, steps, mappings in small:
        grid.add(
            stat_panel(title, description, [Query(expr, instant=True)], unit, steps=steps, mappings=mappings),
            w=4, h=4,
        )  # fmt: skip


def _health_trends(grid: Grid) -> None:
    grid.add(
        timeseries_panel(
            "Alert deliveries by outcome",
            "Posts of alerts per minute to each Alertmanager. `rejected`: a 4xx; `failed`: no answer "
            "or a 5xx.",
            [
                Query(
                    "sum by (alertmanager, outcome) "
                    "(rate(kvcanary_alert_deliveries_total[$__rate_interval])) * 60",
                    "{{alertmanager}}: {{outcome}}",
                )
            ],
            "opm",
            stack=True,
            colors={".*failed": RED, ".*rejected": ORANGE, ".*accepted": GREEN},
        ),
        w=12, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Last run age ÷ interval",
            "Time since each pair last ran, in multiples of its configured interval. Above 3 the "
            "monitor has stopped probing that pair (the same rule as the staleness alert).",
            [
                Query(
                    "(time() - max by (target, probe) "
                    f"(kvcanary_probe_last_run_timestamp_seconds{{{PAIR}}})) / on (target, probe) "
                    f"max by (target, probe) (kvcanary_probe_interval_seconds{{{PAIR}}})",
                    "{{target}} / {{probe}}",
                )
            ],
            "none",
            steps=((GREEN, None), (ORANGE, 2.0), (RED, 3.0)),
        ),
        w=12, h=8,
    )  # fmt: skip


def _freshness(grid: Grid) -> None:
    grid.add(
        table_panel(
            "Probe freshness",
            "Per pair: seconds since the last run and the last passing run, and the configured interval.",
            [
                Query(
                    f"time() - max by (target, probe) (kvcanary_probe_last_run_timestamp_seconds{{{PAIR}}})",
                    table=True,
                ),
                Query(
                    "time() - (max by (target, probe) "
                    f"(kvcanary_probe_last_success_timestamp_seconds{{{PAIR}}}) > 0)",
                    table=True,
                ),
                Query(f"max by (target, probe) (kvcanary_probe_interval_seconds{{{PAIR}}})", table=True),
            ],
            "s",
            merge=True,
            rename={"Value #A": "since last run", "Value #B": "since last pass", "Value #C": "interval"},
        ),
        w=24, h=7,
    )  # fmt: skip
