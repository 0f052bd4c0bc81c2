"""The overview's "Customer traffic" row: what the gateway tap's records came to (``monitor/traffic/``).

Every record the monitor judges counts once per check it ran (``kvcanary_traffic_records_total``):
the ``marker`` check runs on every routed record, so its count is the records judged. Where the taps
publish to NATS JetStream (``traffic.source: jetstream``), the last panels show each replica's
place in the stream (``kvcanary_traffic_stream_*``): whether every partition is consumed, what the
partitions' bucket holds that no real replica writes, lag, and what was taken; over HTTP they stay
empty.
"""

from __future__ import annotations

from kvcanary.dashboards.panels import GREEN, ORANGE, RED, Grid, Query, stat_panel, timeseries_panel

TARGET = 'target=~"$target"'
RECORDS = f"kvcanary_traffic_records_total{{{TARGET}"
FLAGGED = f'{RECORDS}, verdict!="pass"}}'
LEGEND = "{{target}}: {{check}} {{verdict}}"
UNMATCHED = "kvcanary_traffic_unmatched_records_total"
DROPPED = "kvcanary_traffic_tap_dropped_records_total"
STREAM = "kvcanary_traffic_stream_"
TAKEN = f"rate({STREAM}records_total[5m])"


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
    grid.add(
        stat_panel(
            "Traffic stream replicas",
            "Replicas sharing the stream's partitions (live leases in the KV bucket); none: no replica "
            "reaches NATS, and no customer record is judged.",
            [Query(f"max({STREAM}replicas)", instant=True)],
            steps=((RED, None), (GREEN, 1.0)),
        ),
        w=4, h=6,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Traffic stream lag",
            "How long the newest record each replica pulled had waited in NATS; "
            "KVCanaryTrafficStreamBehind fires past 5 minutes held for 10.",
            [Query(f"max by (instance) ({STREAM}lag_seconds)", "{{instance}}")],
            "s",
            colors={".*": ORANGE},
        ),
        w=8, h=6,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Traffic stream: records taken",
            "Records each replica took from the stream per second, by outcome: judged, duplicate "
            "(delivered again after a replica's loss, judged before), rejected (not a valid record) "
            "and misrouted (on a partition its deployment does not hash to: not judged).",
            [Query(f"sum by (instance, outcome) ({TAKEN})", "{{instance}} {{outcome}}")],
            "reqps",
            colors={".*rejected": RED, ".*misrouted": RED, ".*duplicate": ORANGE},
        ),
        w=12, h=6,
    )  # fmt: skip
    grid.add(
        stat_panel(
            "Traffic stream partitions unconsumed",
            "Partitions no replica consumes now (the stream's partitions less those the replicas pull "
            "from): their customers' records wait unjudged. A deleted consumer or stream is made again "
            "within seconds; KVCanaryTrafficPartitionsUnconsumed fires past 5 minutes.",
            [Query(f"max({STREAM}partitions) - sum({STREAM}partition_consuming)", instant=True)],
            steps=((GREEN, None), (RED, 1.0)),
        ),
        w=6, h=6,
    )  # fmt: skip
    grid.add(
        timeseries_panel(
            "Traffic stream bucket anomalies",
            "What the partitions' KV bucket holds that no set of real replicas writes, by kind, the "
            "most any replica reads: replicas over traffic.jetstream.max_replicas, claims without a "
            "heartbeat, partitions withheld past a lease. KVCanaryTrafficBucketForged fires past 2 minutes.",
            [Query(f"max by (kind) ({STREAM}bucket_anomalies)", "{{kind}}")],
            "short",
            colors={".*": RED},
        ),
        w=12, h=6,
    )  # fmt: skip
