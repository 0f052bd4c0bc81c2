"""Which refusals are kept as rows (``monitor/traffic/refusals.py``); the whole path, from a posted
record to its row, its count and no incident, is ``test_traffic_api.py``'s."""

from __future__ import annotations

from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.refusals import REFUSED, ROWS_PER_MINUTE, RefusalRows, refused_row


def refusal(time: float, caller: str = "acme", by: str = "quarantine") -> TrafficRecord:
    return TrafficRecord.model_validate(
        {"id": f"r{time}", "time": time, "caller": caller, "api_base": "http://x", "status": 503,
         "refused": {"by": by, "incident_id": 7}}
    )  # fmt: skip


def test_the_first_rows_of_each_caller_and_cause_a_minute_are_kept_and_a_new_minute_starts_afresh() -> None:
    rows, minute = RefusalRows(), 60.0 * 29_000_000
    kept = [rows.keep("t", refusal(minute + i / 100)) for i in range(ROWS_PER_MINUTE + 5)]
    assert kept == [True] * ROWS_PER_MINUTE + [False] * 5
    assert rows.keep("t", refusal(minute + 1, caller="globex"))  # another caller's own share
    assert rows.keep("t", refusal(minute + 2, by="admission"))  # another cause's
    assert rows.keep("other", refusal(minute + 3))  # another target's
    assert rows.keep("t", refusal(minute + 60))  # the next minute


def test_a_kept_refusal_says_it_was_refused_and_why() -> None:
    row = refused_row({"verdict": "pass", "findings": {}, "caller": "acme"}, refusal(1.0))
    assert row["verdict"] == REFUSED and row["caller"] == "acme"
    assert row["findings"] == {"refused": {"by": "quarantine", "tokens": None, "kv_pool_tokens": None,
                                           "incident_id": 7}}  # fmt: skip
