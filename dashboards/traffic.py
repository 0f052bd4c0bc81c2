"""The overview's "Customer traffic" row: what the gateway tap's records came to (``monitor/traffic/``).

Every record the monitor judges counts once per check it ran (``kvcanary_traffic_records_total``):
the ``marker`` check runs on every routed record, so its count is the records judged.
"""

from __future__ import annotations

from dashboards.panels import GREEN, ORANGE, RED, Grid, Query, stat_panel, timeseries_panel

TARGET = 'target=~"$target"'
RECORDS = f"kvcanary_traffic_records_total{{{TARGET}"
FLAGGED = f'{RECORDS}, verdict!="pass"}}'
LEGEND = "{{target}}: {{check}} {{verdict}}"
UNMATCHED = "kvcanary_traffic_unmatched_records_total"
DROPPED = "kvcanary_traffic_tap_dropped_records_total"


def traffic_row(grid: Grid) -> None:
    grid.row("Customer traffic (gateway tap)")
    grid.add(
        stat_panel(
            "Customer records flagged",
            "Gateway records a check flagged in the selected range: a leak (marker, overlap) or a "
            "mismatch (capacity, tokens). Each opens an incident; GET /api/v1/traffic lists them.",
            [Query(f"round(sum(increase({FLAGGED}[$__range])))", instant=True)],
            steps=((GREEN, None), (RED, 1.0)),
        ),
        w=6, h=6,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Flagged records by check",
            "Flagged gateway records per second, by target, check and verdict.",
            [Query(f"sum by (target, check, verdict) (rate({FLAGGED}[5m]))", LEGEND)],
            "reqps",
            colors={".*leak": RED, ".*mismatch": ORANGE},
        ),
        w=9, h=6,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Records judged, unmatched and dropped",
            "Records judged per second by target; records no target's api_base matched, and records "
            "a gateway's tap dropped (the monitor down or slow), by gateway: both are unjudged traffic.",
            [
                Query(f'sum by (target) (rate({RECORDS}, check="marker"}}[5m]))', "judged: {{target}}"),
                Query(f"sum by (gateway) (rate({UNMATCHED}[5m]))", "unmatched: {{gateway}}"),
                Query(f"sum by (gateway) (rate({DROPPED}[5m]))", "dropped: {{gateway}}"),
            ],
            "reqps",
            colors={"dropped.*": RED, "unmatched.*": ORANGE},
        ),
        w=9, h=6,
    )  # fmt: skip
