"""The traffic checks' registry (``monitor/traffic/checks/``): each check through the judge's own
path on records the tap made from real text, a newcomer's check that is one object and one line,
and a verdict's source carried as a field, from the judge to the page's ``check`` label.

The only seam is the target client the judge asks for a calibration and a pool (network calls,
stubbed as their answers), as in ``test_traffic_judge.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.paging.pager import Delivery, Pager
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.recording.spool import Spool
from kvcanary.monitor.storage import outbox
from kvcanary.monitor.targets.calibration import TokenCalibration
from kvcanary.monitor.traffic.checks import (
    BY_RESULT_KIND,
    CHECKS,
    REGISTRY,
    CheckContext,
    Finding,
    TrafficCheck,
)
from kvcanary.monitor.traffic.judge import Judged, TrafficJudge
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.probes.target import ServerCapacity
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.public import public_prints, tell
from kvcanary.tap.record import Exchange, summarize
from tests.support.monitor_db import minutes, record

FP = Fingerprinter(b"a-test-fingerprint-key-0123456789")
BASE = "http://127.0.0.1:9/v1"
GPL = Path("/usr/share/common-licenses/GPL-3").read_text()
APACHE = Path("/usr/share/common-licenses/Apache-2.0").read_text()


class Target:
    """A target's facts as the judge asks for them: four characters a token at the densest, and
    the node's KV pool."""

    def __init__(self, pool: int):
        self.pool = pool
        self.calibration = TokenCalibration()
        self.calibration.note(1000, 250)

    async def capacity(self, max_age: float = 0.0) -> ServerCapacity:
        return ServerCapacity(kv_pool_tokens=self.pool)


def settings() -> Settings:
    return Settings.model_validate(
        {"targets": [{"name": "t", "base_url": BASE, "tenants": [{"name": "a"}, {"name": "b"}]}]}
    )


def exchange(i: int, caller: str, prompt: str, response: str, **facts: Any) -> TrafficRecord:
    """One exchange as the tap summarizes it (markers found, fingerprints made, no text kept)."""
    made = Exchange(f"r{i}", 1.8e9 + i, caller, "team", BASE, prompt=prompt, response=response, **facts)
    return TrafficRecord.model_validate(summarize(made, FP))


def judge(
    records: list[TrafficRecord],
    *,
    pool: int = 1_000_000,
    markers: MarkerBook | None = None,
    checks: Sequence[TrafficCheck] = REGISTRY,
) -> tuple[TrafficJudge, Judged]:
    metrics = MonitorMetrics(CollectorRegistry())
    made = TrafficJudge(settings(), {"t": Target(pool)}, markers or MarkerBook(), metrics, checks=checks)
    return made, asyncio.run(made.judge(records, "gw"))


def result_of(judged: Judged, kind: str) -> PendingResult:
    (found,) = [r for r in judged.results if r.kind == kind]
    return found


def said(item: PendingResult) -> tuple[str, str, str]:
    """What a result says and who said it."""
    return (item.result.verdict, item.result.reason, item.source)


def kept_rows(judged: Judged) -> list[dict[str, Any]]:
    return [row for _, row in judged.kept]


def test_the_registry_holds_each_check_once_in_judging_order_under_its_stored_kind() -> None:
    # The windowed checks last: each fills its window after judging.
    assert CHECKS == ("marker", "tokens", "capacity", "overlap", "reworded")
    assert [c.result_kind for c in REGISTRY] == [f"traffic_{name}" for name in CHECKS]
    assert {kind: c.name for kind, c in BY_RESULT_KIND.items()} == dict(
        zip([c.result_kind for c in REGISTRY], CHECKS, strict=True)
    )
    assert [c.name for c in REGISTRY if c.judges_pool] == ["capacity"]
    for check in REGISTRY:
        assert check.passed == Finding(check.name, Verdict.PASS) and not check.passed.flagged


def test_a_live_marker_in_a_customers_answer_is_a_marker_leak_whose_row_names_the_marker() -> None:
    book = MarkerBook()
    marker_id, marker = book.plant("t", "a")
    forged = "KVC-00000000-" + "ab" * 24
    records = [
        exchange(1, "acme", "What did the last user say?", f"They said: {marker} and more."),
        exchange(2, "globex", "Print a marker.", f"Here: {forged}"),
        exchange(3, "initech", "Hello.", "Hello to you."),
    ]
    _, judged = judge(records, markers=book)
    item = result_of(judged, "traffic_marker")
    assert said(item) == ("leak", "probe_marker_in_customer_response", "traffic")
    evidence = item.result.evidence
    assert (evidence["flagged"], evidence["passed"]) == (1, 2)  # the forged one is nobody's
    (named,) = evidence["records"]
    assert (named["request_id"], named["markers"]) == (records[0].id, 1)  # a count: the result stays small
    (row,) = kept_rows(judged)
    assert row["verdict"] == "leak" and row["checks"] == ",marker,"
    (evidence,) = row["findings"]["marker"]["markers"]  # the finding's evidence, in the row
    assert (evidence["marker_id"], evidence["owner_tenant"]) == (marker_id, "a")
    assert marker not in str(row)  # ids and digests, never the marker


def test_an_impossible_prompt_token_count_is_a_tokens_mismatch_and_a_plausible_one_passes() -> None:
    prompt = GPL[:4000]  # 4,000 characters: at least 1,000 tokens at the densest text calibrated
    records = [
        exchange(1, "acme", prompt, "Done.", prompt_tokens=1),  # the incident's tell
        exchange(2, "globex", prompt, "Done.", prompt_tokens=950),
        exchange(3, "initech", prompt[:500], "Done.", prompt_tokens=1),  # too short to say
    ]
    _, judged = judge(records)
    item = result_of(judged, "traffic_tokens")
    assert said(item) == ("mismatch", "prompt_tokens_impossible", "traffic")
    assert (item.result.evidence["flagged"], item.result.evidence["passed"]) == (1, 1)
    (named,) = item.result.evidence["records"]
    assert (named["request_id"], named["prompt_tokens"], named["floor"]) == (records[0].id, 1, 125.0)
    (row,) = kept_rows(judged)
    assert row["findings"]["tokens"]["verdict"] == "mismatch" and row["checks"] == ",tokens,"


def test_an_answered_prompt_over_the_nodes_pool_is_a_capacity_mismatch() -> None:
    prompt = GPL[:4000]
    records = [
        exchange(1, "acme", prompt, "Done.", prompt_tokens=1000),  # over a 500-token pool, answered
        exchange(2, "globex", prompt[:1200], "Done.", prompt_tokens=300),  # under it
        exchange(3, "initech", prompt, "", prompt_tokens=1000, status=503),  # refused: not judged
    ]
    _, judged = judge(records, pool=500)
    item = result_of(judged, "traffic_capacity")
    assert said(item) == ("mismatch", "over_pool_answered", "traffic")
    assert (item.result.evidence["flagged"], item.result.evidence["passed"]) == (1, 1)
    (named,) = item.result.evidence["records"]
    assert (named["estimated_prompt_tokens"], named["kv_pool_tokens"]) == (1000, 500)
    flagged = [row for row in kept_rows(judged) if row["verdict"] != "pass"]
    assert [row["request_id"] for row in flagged] == [records[0].id]  # the refused one: kept, unflagged


def test_another_callers_text_in_an_answer_is_an_overlap_leak() -> None:
    records = [
        exchange(1, "acme", "Keep my notes: " + GPL[:6000], "Kept."),
        exchange(2, "globex", "What is the capital of Peru?", "Lima."),
        exchange(3, "initech", "Summarize my meeting.", "Sure: " + GPL[2000:3500]),
    ]
    _, judged = judge(records)
    item = result_of(judged, "traffic_overlap")
    assert said(item) == ("leak", "another_callers_text", "traffic")
    (named,) = item.result.evidence["records"]
    assert named["caller"] == "initech" and named["other_caller"] == "acme" and named["run"] >= 8


def test_a_public_text_the_tap_was_told_of_is_no_ones_when_the_model_recites_it() -> None:
    """The licence one caller pasted, recited to another: the same exchanges as above, but the
    gateway's tap was told the licence is public (``KVCANARY_TAP_PUBLIC_TEXTS``)."""
    told = Fingerprinter(b"traffic-checks-key-0123456789abcdef")
    known = public_prints([GPL], told)
    assert len(known.prints) > 1000
    tell(told, known)

    def summarized(i: int, caller: str, prompt: str, response: str) -> TrafficRecord:
        made = Exchange(f"r{i}", 1.8e9 + i, caller, "team", BASE, prompt=prompt, response=response)
        return TrafficRecord.model_validate(summarize(made, told))

    records = [
        summarized(1, "acme", "Keep my notes: " + GPL[:6000], "Kept."),
        summarized(2, "initech", "Summarize my meeting.", "Sure: " + GPL[2000:3500]),
    ]
    assert len(records[0].fingerprints.prompt) == 1  # the whole prompt's print alone: the rest is public
    recital = records[1].fingerprints.response  # every print of it no one's (OWN), but where "Sure:" is
    assert recital.count(0) > 50 and len(recital) - recital.count(0) <= 2, recital
    _, judged = judge(records)
    assert said(result_of(judged, "traffic_overlap"))[0] == "pass"
    # A caller's own words beside the licence are still its own: quoted to another, a leak.
    notes = "Our launch code name is Bluefinch and the budget for the Ravenna office opens in March. " * 8
    leaked = [
        summarized(3, "acme", "Keep my notes: " + GPL[:3000] + notes, "Kept."),
        summarized(4, "initech", "Summarize my meeting.", "Sure: " + notes[:400]),
    ]
    _, judged = judge(leaked)
    assert said(result_of(judged, "traffic_overlap"))[:2] == ("leak", "another_callers_text")


class LongWaitCheck(TrafficCheck):
    """What a newcomer adds: an answer that took over a minute is a finding (one class, no more)."""

    name = "long_wait"
    needs = frozenset()

    def judge(self, record: TrafficRecord, context: CheckContext) -> Finding | None:
        if record.latency_seconds is None:
            return None
        if record.latency_seconds <= 60:
            return self.passed
        figures = {"seconds": record.latency_seconds}
        return Finding(self.name, Verdict.MISMATCH, "answered_after_a_minute", figures)


def test_a_newcomers_check_is_one_object_whose_verdict_becomes_a_traffic_result() -> None:
    records = [
        exchange(1, "acme", "Write me an essay.", APACHE[:800], latency_seconds=95.0),
        exchange(2, "globex", "Hello.", "Hello to you.", latency_seconds=0.4),
        exchange(3, "initech", "Hello again.", "Hi.", latency_seconds=None),
    ]
    made, judged = judge(records, checks=(*REGISTRY, LongWaitCheck()))
    item = result_of(judged, "traffic_long_wait")
    assert said(item) == ("mismatch", "answered_after_a_minute", "traffic")
    assert (item.result.evidence["flagged"], item.result.evidence["passed"]) == (1, 1)
    assert item.result.evidence["records"][0]["seconds"] == 95.0
    (row,) = kept_rows(judged)
    assert row["checks"] == ",long_wait,"
    assert row["findings"]["long_wait"]["reason"] == "answered_after_a_minute"
    counted = made.metrics.registry.get_sample_value(
        "kvcanary_traffic_records_total", {"target": "t", "check": "long_wait", "verdict": "mismatch"}
    )
    assert counted == 1
    # The registry's own checks ran beside it, and a judge given the registry alone knows nothing of it.
    assert {r.kind for r in judged.results} >= {"traffic_marker", "traffic_overlap"}
    assert "traffic_long_wait" not in {r.kind for r in judge(records)[1].results}


def test_a_check_that_needs_what_the_context_does_not_hold_fails_when_it_is_defined() -> None:
    with pytest.raises(TypeError, match="prompt_text"):

        class ReadsText(TrafficCheck):  # a record's text never reaches the monitor
            name = "reads_text"
            needs = frozenset({"prompt_text"})

            def judge(self, record: TrafficRecord, context: CheckContext) -> Finding | None:
                return None


def test_a_traffic_results_source_survives_the_spool(tmp_path: Path) -> None:
    records = [exchange(1, "acme", "Hello.", "Hi.")]
    (item, *_) = judge(records)[1].results
    spool = Spool(tmp_path / "spool")
    spool.append(item)
    spool.close()
    replayed = Spool(tmp_path / "spool").head()
    assert replayed is not None and (replayed.kind, replayed.source) == (item.kind, "traffic")


def test_a_traffic_incidents_page_names_its_check_and_a_probes_does_not(
    session_factory: sessionmaker[Session],
) -> None:
    records = [
        exchange(1, "acme", "Keep my notes: " + GPL[:6000], "Kept."),
        exchange(2, "initech", "Summarize my meeting.", "Sure: " + GPL[2000:3500]),
    ]
    made, judged = judge(records)
    recorder = Recorder(made.settings, session_factory, Spool(None))
    for item in judged.results:
        recorder.record(item)
    record(session_factory, "mismatch", at=minutes(0), probe="capacity")  # a probe's kind, a check's name
    pager = Pager(made.settings, session_factory, Delivery({}, made.metrics, timeout=5))
    with session_factory() as s, s.begin():
        events = outbox.claim(s, claimer="test", now=datetime.now(UTC), lease_seconds=60)
    labels = {e.incident.probe: pager.alerts_for(e)[0]["labels"] for e in events}
    asyncio.run(pager.delivery.aclose())
    leak = labels["traffic_overlap"]
    assert (leak["check"], leak["severity"]) == ("overlap", "critical")
    assert "check" not in labels["capacity"]
    # The copied licence holds acme's names too (its capitalised words): the reworded check sees it as
    # well; the passing checks opened nothing.
    assert set(labels) == {"traffic_overlap", "traffic_reworded", "capacity"}
    assert labels["traffic_reworded"]["check"] == "reworded"
