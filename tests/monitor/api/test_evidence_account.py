"""What the incident page tells of a result's evidence, and its chart's axes: a few lines a person
reads at a glance (``monitor/api/evidence_account.py``), from the evidence the probes and the
traffic checks really store, and ticks that say what the bars count and when."""

from __future__ import annotations

from datetime import UTC, datetime

from kvcanary.monitor.api.evidence_account import MAX_LINES, account
from kvcanary.monitor.blast.chart import HEIGHT, chart_of


def test_a_cross_tenant_leak_says_whose_marker_came_back_to_whom() -> None:
    evidence = {
        "leaks": [{"marker_id": "0badc0de", "owner_tenant": "alice", "reader_tenant": "bob",
                   "marker_sha256": "ab" * 32, "excerpt": "left out of this page"}],
        "leak_count": 1, "leak_occurrences": 3,
    }  # fmt: skip
    assert account(evidence) == ["marker 0badc0de of alice came back to bob; 1 marker(s) in all, 3 time(s)"]


def test_an_over_pool_answer_says_the_sizes_and_the_pool() -> None:
    evidence = {
        "status_code": 200, "prompt_tokens_sent": 1033, "prompt_tokens_reported": 1,
        "capacity": {"context_window": 8192, "pools": {"prefill": 1024, "decode": 8192}},
    }  # fmt: skip
    assert account(evidence) == [
        "HTTP 200: prompt of 1,033 tokens sent, 1 reported by the engine",
        "KV pool prefill 1,024, decode 8,192 tokens against a context window of 8,192",
    ]


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
    assert chart.counts[0].at == chart.base and chart.counts[-1].at < chart.counts[0].at  # up is more
    assert chart.times[0].moment == start and chart.times[-1].moment == chart.last
    assert [t.moment.strftime("%H:%M") for t in chart.times if t.moment] == [
        "09:00",
        "09:02",
        "09:04",
        "09:06",
        "09:08",
    ]
    assert all(chart.left <= bar.x < chart.width and bar.y + bar.height == chart.base for bar in chart.bars)
    assert max(bar.height for bar in chart.bars) <= HEIGHT - chart.axis
    assert chart_of([0, 0], start, 60) is None
