"""What the incident page tells of a result's evidence, and its chart's axes: a few lines a person
reads at a glance (``monitor/api/evidence_account.py``), from the evidence the probes and the
traffic checks really store, and ticks that say what the bars count and when."""

from __future__ import annotations

from datetime import UTC, datetime

from kvcanary.monitor.api.evidence_account import MAX_LINES, account, tells_sizes
from kvcanary.monitor.blast.chart import HEIGHT, WIDTH, chart_of


def test_a_cross_tenant_leak_says_whose_marker_came_back_to_whom() -> None:
    evidence = {
        "leaks": [{"marker_id": "0badc0de", "owner_tenant": "alice", "reader_tenant": "bob",
                   "marker_sha256": "ab" * 32, "excerpt": "left out of this page"}],
        "leak_count": 1, "leak_occurrences": 3,
    }  # fmt: skip
    assert account(evidence) == ["marker 0badc0de of alice came back to bob (3 times)"]
    # Once, a marker of the result's own target: no count, no target named again.
    evidence["leaks"][0]["owner_target"] = "glm-prod"
    evidence["leak_occurrences"] = 1
    assert account(evidence, "glm-prod") == ["marker 0badc0de of alice came back to bob"]
    assert account(evidence, "glm-dev") == ["marker 0badc0de of alice (glm-prod) came back to bob"]


def test_more_markers_than_are_named_are_counted_in_all() -> None:
    leaks = [{"marker_id": f"m{i}", "owner_tenant": "alice", "reader_tenant": "bob"} for i in range(5)]
    told = account({"leaks": leaks, "leak_count": 5, "leak_occurrences": 12})
    assert told == [
        "marker m0 of alice came back to bob; marker m1 of alice came back to bob; "
        "marker m2 of alice came back to bob; 5 markers in all, 12 times"
    ]


def test_an_over_pool_answer_says_the_sizes_and_the_pool() -> None:
    evidence = {
        "status_code": 200, "prompt_tokens_sent": 1033, "prompt_tokens_reported": 1,
        "capacity": {"context_window": 8192, "pools": {"prefill": 1024, "decode": 8192}},
    }  # fmt: skip
    assert account(evidence) == [
        "HTTP 200: prompt of 1,033 tokens sent, 1 reported by the engine",
        "KV pools: prefill 1,024, decode 8,192 tokens; context window 8,192 tokens",
    ]
    assert tells_sizes(evidence)


def test_a_refusal_says_the_engine_gave_no_count_rather_than_none() -> None:
    evidence = {"status_code": 400, "prompt_tokens_sent": 8195, "prompt_tokens_reported": None,
                "capacity": {"kv_pool_tokens": 8192}}  # fmt: skip
    assert account(evidence) == [
        "HTTP 400: prompt of 8,195 tokens sent, no count from the engine",
        "KV pool: 8,192 tokens",
    ]
    assert not tells_sizes({"capacity": {"kv_pool_tokens": 8192}})


def test_failed_gateway_records_are_named_by_request_and_caller_a_few_at_a_time() -> None:
    records = [{"request_id": f"req-{i}", "caller": f"team-{i}", "reason": "prompt_run"} for i in range(9)]
    told = account({"gateway": "gw-1", "flagged": 9, "records": records})
    assert told == [
        "9 gateway record(s) failed through gateway gw-1: request req-0 of team-0 (prompt_run); "
        "request req-1 of team-1 (prompt_run); request req-2 of team-2 (prompt_run)"
    ]


def test_an_unknown_or_hostile_evidence_tells_nothing_and_never_much() -> None:
    assert account({"whatever": {"nested": [1, 2]}, "leaks": "not a list", "records": [3]}) == []
    many = {"leaks": [{"marker_id": "m"}], "records": [{"request_id": "r"}], "prompt_tokens_sent": 1,
            "context_window": 9, "path": {"prefill": "p", "decode": "d"}}  # fmt: skip
    assert 1 <= len(account(many)) <= MAX_LINES


def test_the_chart_has_a_count_axis_from_zero_to_the_peak_and_time_ticks_across_the_window() -> None:
    start = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)
    chart = chart_of([0, 4, 0, 8, 2, 0, 0, 1], start, 60)
    assert chart is not None
    assert [t.count for t in chart.counts] == [0, 4, 8]
    # Up is more: a count's place is a percentage of the height from the top.
    assert chart.counts[0].at == 100 and 0 < chart.counts[-1].at < chart.counts[1].at < 100
    assert chart.times[0].moment == start and chart.times[-1].moment == chart.last
    assert [t.at for t in chart.times] == [0, 25, 50, 75, 100]
    assert [t.moment.strftime("%H:%M") for t in chart.times if t.moment] == [
        "09:00",
        "09:02",
        "09:04",
        "09:06",
        "09:08",
    ]
    assert all(0 <= bar.x < WIDTH and bar.y + bar.height == HEIGHT for bar in chart.bars)
    peak = max(chart.bars, key=lambda bar: bar.count)
    assert peak.y == round(chart.counts[-1].at * HEIGHT / 100, 2)  # the peak's bar meets its label
    assert chart.bucket_said == "60 s"
    assert chart_of([0, 0], start, 60) is None


def test_the_chart_spans_the_window_not_its_last_bucket_and_says_a_bar_in_minutes() -> None:
    # A 2-hour window in 48 buckets of 151 s: the last bucket passes the window's end by 38 s.
    start = datetime(2026, 12, 6, 8, 0, tzinfo=UTC)
    end = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)
    chart = chart_of([1] * 48, start, 151, end)
    assert chart is not None and chart.last == end and chart.times[-1].moment == end
    last = chart.bars[-1]
    assert last.x + last.width <= WIDTH  # cut at the window's end, not drawn past the box
    assert chart.bucket_said == "2 min 31 s"
    five = chart_of([1], start, 300)
    assert five is not None and five.bucket_said == "5 min"
