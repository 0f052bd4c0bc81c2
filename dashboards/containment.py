"""The overview's "Paths and containment" row: whether every prefill x decode path of a
disaggregated target is being judged (``kvcanary_path_*``, the target's path probes), and every node
audited (``kvcanary_node_last_judged_timestamp``, the nodes a gateway lists coming and going), which
targets the gateways are told to stop sending customers to (``kvcanary_target_quarantine*``), and
the requests the gateways refused (``kvcanary_traffic_refused_total``).
Targets without paths, or with containment left at ``observe`` and nothing found, leave the
panels empty or at 0."""

from __future__ import annotations

from kvcanary.dashboards.panels import GREEN, ORANGE, RED, Grid, Query, stat_panel, timeseries_panel

TARGET = 'target=~"$target"'
NODE = 'target=~"$target", node=~"$node"'


def age_in_intervals(subject: str, by: str, selector: str) -> str:
    """Seconds since each ``subject`` (path, node) was last judged, over the target's interval for it."""
    return (
        f"(time() - max by (target, {by}) (kvcanary_{subject}_last_judged_timestamp{{{selector}}}))"
        f" / on (target) group_left ()"
        f" max by (target) (kvcanary_{subject}_judge_interval_seconds{{{TARGET}}})"
    )


#: Each path's age: above 3, KVCanaryPathNotJudged.
PATH_AGE = age_in_intervals("path", "prefill, decode", TARGET)
#: Each node's audits' age (capacity, version, counters).
NODE_AGE = age_in_intervals("node", "node", NODE)

#: Nodes joining and leaving each target's gateway listing, per quarter of an hour.
NODE_CHANGES = f"sum by (target, change) (increase(kvcanary_gateway_node_changes_total{{{TARGET}}}[15m]))"


def containment_row(grid: Grid) -> None:
    grid.row("Paths and containment")
    grid.add(
        stat_panel(
            "Path age, in intervals",
            "Per prefill x decode path of a disaggregated target: the time since a probe sent down it "
            "was last judged, in the target's path intervals. Above 3 (red) the path is unchecked "
            "(KVCanaryPathNotJudged): a node down, a failing hand-off, or runs held up.",
            [Query(PATH_AGE, "{{target}}: {{prefill}} → {{decode}}", instant=True)],
            "none",
            steps=((GREEN, None), (ORANGE, 2.0), (RED, 3.0)),
            decimals=1,
        ),
        w=9, h=8,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Pairs not probed",
            "Per target and why: prefill x decode pairs no probe is sent down, so no path age above "
            "either (KVCanaryPathsUnprobed): a prefill node whose bootstrap port is unknown, or pairs "
            "past the 256 a target is probed down.",
            [Query(f"max by (target, reason) (kvcanary_paths_unprobed{{{TARGET}}})", "{{target}}: {{reason}}",
                   instant=True)],
            "none",
            steps=((GREEN, None), (ORANGE, 1.0)),
        ),
        w=3, h=8,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Quarantined",
            "Per target: 1 while the gateways' taps are told to send it no customer request (a leak's "
            "incident under containment.mode: quarantine, or an operator's quarantine).",
            [Query(f"max by (target) (kvcanary_target_quarantined{{{TARGET}}})", "{{target}}", instant=True)],
            "none",
            steps=((GREEN, None), (RED, 1.0)),
            mappings={"0": ("routed", GREEN), "1": ("quarantined", RED)},
        ),
        w=6, h=8,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Would be quarantined (observe)",
            "Per target: 1 while the observe policy records that a leak would have quarantined it; "
            "the gateways route as before. Read before switching containment.mode to quarantine.",
            [Query(f"max by (target) (kvcanary_target_quarantine_observed{{{TARGET}}})", "{{target}}",
                   instant=True)],
            "none",
            steps=((GREEN, None), (ORANGE, 1.0)),
            mappings={"0": ("no", GREEN), "1": ("would be", ORANGE)},
        ),
        w=6, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Refused by the gateways",
            "Requests per second the gateways' taps refused before any upstream call, by target and "
            "cause: admission (the prompt surely over the KV pool of every deployment that would take "
            "it) or quarantine (every deployment of its group quarantined). Kept as traffic records "
            "with the verdict refused (GET /api/v1/traffic?verdict=refused); never an incident.",
            [Query(f"sum by (target, by) (rate(kvcanary_traffic_refused_total{{{TARGET}}}[5m]))",
                   "{{target}}: {{by}}")],
            "reqps",
            colors={".*quarantine": RED, ".*admission": ORANGE},
        ),
        w=24, h=6,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Node age, in intervals",
            "Per node (a node a gateway lists included): the time since an audit of it (capacity, "
            "version, counters) was last judged, in the target's node intervals. Above 3 (red) its "
            "audits have only erred: a node down or unreachable from the monitor.",
            [Query(NODE_AGE, "{{target}}: {{node}}", instant=True)],
            "none",
            steps=((GREEN, None), (ORANGE, 2.0), (RED, 3.0)),
            decimals=1,
        ),
        w=12, h=8,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Gateway nodes joining and leaving",
            "Per target and change: nodes that joined or left its SGLang gateway's listing, as "
            "discovery read GET /workers (a joining node is audited at once). Churn here and paths "
            "going stale together: a node flapping.",
            [Query(NODE_CHANGES, "{{target}}: {{change}}")],
            "short",
            colors={".*left": ORANGE, ".*joined": GREEN},
        ),
        w=12, h=8,
    )  # fmt: skip
