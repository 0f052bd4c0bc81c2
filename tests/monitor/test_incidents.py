"""The incident lifecycle, recorded on real SQLite and PostgreSQL (see conftest.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import IncidentConfig
from kvcanary.monitor.incidents import RecordOutcome, record_result, resolve_incident
from kvcanary.monitor.storage.models import Incident, IncidentEvent, ProbeResultRow, Target
from kvcanary.monitor.storage.result_rows import TITLE_CHARS
from kvcanary.monitor.storage.retention import prune_expired
from tests.support.monitor_db import POLICY, RETENTION, T0, minutes, outcome, record

Factory = sessionmaker[Session]


def incidents(factory: Factory) -> list[Incident]:
    with factory() as s:
        return list(s.scalars(select(Incident).order_by(Incident.id)))


def events(factory: Factory, incident_id: int) -> list[tuple[str, str | None, str]]:
    with factory() as s:
        rows = s.execute(
            select(IncidentEvent.kind, IncidentEvent.old_severity, IncidentEvent.new_severity)
            .where(IncidentEvent.incident_id == incident_id)
            .order_by(IncidentEvent.id)
        )
        return [tuple(r) for r in rows]


def test_a_pass_with_nothing_open_records_the_result_and_opens_nothing(session_factory: Factory) -> None:
    out = record(session_factory, "pass", at=T0, latency_seconds=0.25, status_code=200.0)

    assert out == RecordOutcome(out.result_id, None, None, None)
    assert incidents(session_factory) == []
    with session_factory() as s:
        row = s.get_one(ProbeResultRow, out.result_id)
        assert (row.verdict, row.status_code, row.latency_seconds, row.ttft_seconds) == (
            "pass",
            200,
            0.25,
            None,
        )
        assert row.expires_at == T0 + timedelta(days=RETENTION.pass_days)
        assert row.started_at == T0 and row.started_at.tzinfo is not None


def test_a_leak_opens_one_critical_incident_with_an_opened_event(session_factory: Factory) -> None:
    out = record(
        session_factory, "leak", at=T0, detail="2 live marker(s) of tenant(s) alice came back to bob"
    )

    assert (out.change, out.severity) == ("opened", "critical")
    [incident] = incidents(session_factory)
    assert incident.id == out.incident_id
    assert (incident.state, incident.failure_count, incident.probe) == ("open", 1, "cross_tenant")
    assert (
        incident.title
        == "leak on glm-prod/cross_tenant: 2 live marker(s) of tenant(s) alice came back to bob"
    )
    assert events(session_factory, incident.id) == [("opened", None, "critical")]
    with session_factory() as s:
        row = s.get_one(ProbeResultRow, out.result_id)
        assert row.incident_id == incident.id
        assert row.expires_at == T0 + timedelta(days=RETENTION.failure_days)
        assert row.evidence == {"marker_ids": ["m-1"]}


def test_repeated_failures_attach_to_the_open_incident_without_noise(session_factory: Factory) -> None:
    first = record(session_factory, "mismatch", at=minutes(0))
    outs = [record(session_factory, "mismatch", at=minutes(i)) for i in range(1, 4)]

    assert {o.change for o in outs} == {"attached"}
    assert {o.incident_id for o in outs} == {first.incident_id}
    [incident] = incidents(session_factory)
    assert (incident.severity, incident.failure_count, incident.last_failure_at) == ("high", 4, minutes(3))
    # The same failure again is counted, not written to the timeline.
    assert events(session_factory, incident.id) == [("opened", None, "high")]


def test_a_worse_verdict_escalates_and_a_milder_one_never_de_escalates(session_factory: Factory) -> None:
    opened = record(session_factory, "mismatch", at=minutes(0))
    escalated = record(session_factory, "leak", at=minutes(1), detail="alice's marker reached bob")
    milder = record(session_factory, "mismatch", at=minutes(2))

    assert (opened.severity, escalated.change, escalated.severity) == ("high", "escalated", "critical")
    assert (milder.change, milder.severity) == ("attached", "critical")
    [incident] = incidents(session_factory)
    assert incident.severity == "critical"
    assert incident.title.startswith("leak on glm-prod/cross_tenant: alice's marker")
    assert events(session_factory, incident.id)[:2] == [
        ("opened", None, "high"),
        ("escalated", "high", "critical"),
    ]


def test_enough_passes_in_a_row_resolve_the_incident_once(session_factory: Factory) -> None:
    opened = record(session_factory, "leak", at=minutes(0))
    passes = [record(session_factory, "pass", at=minutes(i)) for i in (1, 2, 3)]
    after = record(session_factory, "pass", at=minutes(4))

    assert [p.change for p in passes] == [None, None, "resolved"]
    assert {p.incident_id for p in passes} == {opened.incident_id}
    assert after == RecordOutcome(after.result_id, None, None, None)
    [incident] = incidents(session_factory)
    assert (incident.state, incident.resolved_at) == ("resolved", minutes(3) + timedelta(seconds=1))
    assert [e[0] for e in events(session_factory, incident.id)] == ["opened", "resolved"]


def test_passes_that_started_before_the_last_failure_never_resolve_it(session_factory: Factory) -> None:
    """Passes replayed late from a spool (or run by a replica that had not seen the leak) describe the
    time before it: they must not count toward resolving the incident the leak opened."""
    opened = record(session_factory, "leak", at=minutes(10))
    stale = [record(session_factory, "pass", at=minutes(i)) for i in (7, 8, 9)]
    assert [p.change for p in stale] == [None, None, None]
    [incident] = incidents(session_factory)
    assert (incident.state, incident.consecutive_passes) == ("open", 0)
    fresh = [record(session_factory, "pass", at=minutes(i)) for i in (11, 12, 13)]
    assert [p.change for p in fresh] == [None, None, "resolved"]
    assert {p.incident_id for p in fresh} == {opened.incident_id}


def test_a_failure_after_resolution_opens_a_new_incident(session_factory: Factory) -> None:
    first = record(session_factory, "leak", at=minutes(0))
    for i in (1, 2, 3):
        record(session_factory, "pass", at=minutes(i))
    second = record(session_factory, "leak", at=minutes(4))

    assert second.change == "opened" and second.incident_id != first.incident_id
    assert [i.state for i in incidents(session_factory)] == ["resolved", "open"]


def test_a_flapping_probe_keeps_one_incident_open(session_factory: Factory) -> None:
    for i in range(0, 40, 2):
        record(session_factory, "leak", at=minutes(i))
        record(session_factory, "pass", at=minutes(i + 1))

    [incident] = incidents(session_factory)
    assert (incident.state, incident.failure_count, incident.consecutive_passes) == ("open", 20, 1)
    kinds = [e[0] for e in events(session_factory, incident.id)]
    # Each relapse after a pass is one timeline row; nothing else is.
    assert kinds == ["opened"] + ["failure"] * 19


def test_errors_never_open_a_leak_incident_and_warn_only_past_the_threshold(session_factory: Factory) -> None:
    early = [record(session_factory, "error", at=T0 + timedelta(seconds=s)) for s in (0, 60, 120, 299)]
    assert {(o.incident_id, o.change) for o in early} == {(None, None)}

    warned = record(session_factory, "error", at=T0 + timedelta(seconds=300), reason="connect")

    assert (warned.change, warned.severity) == ("opened", "warning")
    [incident] = incidents(session_factory)
    assert incident.failure_count == 5
    assert incident.title.startswith("errors on glm-prod/cross_tenant for 300s: connect")
    with session_factory() as s:
        linked = s.scalars(select(ProbeResultRow.incident_id)).all()
    assert linked == [incident.id] * 5, "the errors that opened it are its evidence"


def test_a_pass_restarts_the_error_clock(session_factory: Factory) -> None:
    record(session_factory, "error", at=minutes(0))
    record(session_factory, "error", at=minutes(4))
    record(session_factory, "pass", at=minutes(4.5))
    outs = [record(session_factory, "error", at=minutes(m)) for m in (5, 9)]

    assert {o.incident_id for o in outs} == {None}
    assert record(session_factory, "error", at=minutes(10)).change == "opened"


def test_errors_neither_fail_nor_pass_a_leak_incident(session_factory: Factory) -> None:
    opened = record(session_factory, "leak", at=minutes(0))
    record(session_factory, "pass", at=minutes(1))
    record(session_factory, "pass", at=minutes(2))
    errors = [record(session_factory, "error", at=minutes(m)) for m in range(3, 30)]
    resolved = record(session_factory, "pass", at=minutes(30))

    assert {(e.incident_id, e.change, e.severity) for e in errors} == {(opened.incident_id, None, "critical")}
    assert resolved.change == "resolved", "errors did not reset the passes"
    [incident] = incidents(session_factory)
    assert (incident.severity, incident.failure_count) == ("critical", 1)


def test_a_leak_escalates_an_error_warning_to_critical(session_factory: Factory) -> None:
    policy = IncidentConfig(resolve_after_passes=3, error_warning_after_seconds=0)
    warned = record(session_factory, "error", at=minutes(0), policy=policy)
    leak = record(session_factory, "leak", at=minutes(1), policy=policy)

    assert (warned.severity, leak.change, leak.severity) == ("warning", "escalated", "critical")
    assert leak.incident_id == warned.incident_id


def test_errors_count_against_a_warning_incident_and_reset_its_passes(session_factory: Factory) -> None:
    policy = IncidentConfig(resolve_after_passes=2, error_warning_after_seconds=0)
    warned = record(session_factory, "error", at=minutes(0), policy=policy)
    record(session_factory, "pass", at=minutes(1), policy=policy)
    relapse = record(session_factory, "error", at=minutes(2), policy=policy)
    record(session_factory, "pass", at=minutes(3), policy=policy)
    resolved = record(session_factory, "pass", at=minutes(4), policy=policy)

    assert (relapse.change, relapse.incident_id) == ("attached", warned.incident_id)
    assert resolved.change == "resolved"


def test_incidents_are_kept_per_target_and_probe(session_factory: Factory) -> None:
    a = record(session_factory, "leak", at=T0, target="glm-prod", probe="cross_tenant")
    b = record(session_factory, "leak", at=T0, target="glm-prod", probe="boundary")
    c = record(session_factory, "leak", at=T0, target="llama-dev", probe="cross_tenant")

    assert len({a.incident_id, b.incident_id, c.incident_id}) == 3
    with session_factory() as s:
        assert s.scalar(select(func.count()).select_from(Target)) == 2


def test_the_target_row_follows_configuration_changes(session_factory: Factory) -> None:
    record(session_factory, "pass", at=minutes(0))
    with session_factory() as s, s.begin():
        record_result(
            s,
            target_name="glm-prod",
            engine="vllm",
            base_url="https://u:secret@gpu-7:8000/v1?key=x",
            model="glm-5.3-fp8",
            probe="canary",
            result=outcome("pass"),
            started_at=minutes(1),
            duration_seconds=1.0,
            policy=POLICY,
            retention=RETENTION,
            now=minutes(1),
        )
    with session_factory() as s:
        [target] = s.scalars(select(Target)).all()
    assert (target.engine, target.base_url, target.model) == ("vllm", "https://gpu-7:8000/v1", "glm-5.3-fp8")
    assert (target.created_at, target.updated_at) == (minutes(0) + timedelta(seconds=1), minutes(1))


def test_long_details_and_odd_evidence_are_stored_bounded_and_as_json(session_factory: Factory) -> None:
    result = outcome("mismatch", reason="r" * 100, detail="word " * 200)
    result.evidence = {"ids": {3}, "raw": b"\x00"}
    with session_factory() as s, s.begin():
        out = record_result(
            s,
            target_name="glm-prod",
            engine="sglang",
            base_url="http://h:1",
            model="m",
            probe="canary",
            result=result,
            started_at=T0,
            duration_seconds=1.0,
            policy=POLICY,
            retention=RETENTION,
        )
    with session_factory() as s:
        row = s.get_one(ProbeResultRow, out.result_id)
        incident = s.get_one(Incident, out.incident_id)
    assert len(row.reason) == 64 and row.evidence == {"ids": "{3}", "raw": "b'\\x00'"}
    # Bounded, and ending on a whole word: "word word … word…", never "wo…".
    assert len(incident.title) <= TITLE_CHARS and incident.title.endswith("word…")


def test_record_result_refuses_an_unknown_verdict(session: Session) -> None:
    result = outcome("pass")
    result.verdict = "maybe"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="verdict must be one of"):
        record_result(
            session,
            target_name="t",
            engine="e",
            base_url="http://h",
            model="m",
            probe="p",
            result=result,
            started_at=T0,
            duration_seconds=0.1,
            policy=POLICY,
            retention=RETENTION,
        )


def test_resolving_is_a_compare_and_set_that_only_one_caller_wins(session_factory: Factory) -> None:
    opened = record(session_factory, "leak", at=T0)
    assert opened.incident_id is not None
    first, second = session_factory(), session_factory()
    try:
        won = resolve_incident(first, incident_id=opened.incident_id, now=minutes(5))
        first.commit()
        lost = resolve_incident(second, incident_id=opened.incident_id, now=minutes(6))
        second.commit()
    finally:
        first.close()
        second.close()

    assert (won, lost) == (True, False)
    [incident] = incidents(session_factory)
    assert incident.resolved_at == minutes(5)
    assert [e[0] for e in events(session_factory, incident.id)] == ["opened", "resolved"]


def test_prune_deletes_expired_results_but_keeps_an_open_incidents_evidence(session_factory: Factory) -> None:
    old_pass = record(session_factory, "pass", at=minutes(0), probe="canary")
    open_leak = record(session_factory, "leak", at=minutes(0), probe="cross_tenant")
    closed = record(session_factory, "mismatch", at=minutes(0), probe="boundary")
    for i in (1, 2, 3):
        record(session_factory, "pass", at=minutes(i), probe="boundary")
    fresh_pass = record(session_factory, "pass", at=minutes(0) + timedelta(days=85), probe="canary")

    with session_factory() as s, s.begin():
        # The unlinked pass, and the passes of the incident that is resolved by now.
        assert prune_expired(s, now=T0 + timedelta(days=8)) == 4
    with session_factory() as s, s.begin():
        removed = prune_expired(s, now=T0 + timedelta(days=91))

    with session_factory() as s:
        left = set(s.scalars(select(ProbeResultRow.id)))
        event_links = s.scalars(
            select(IncidentEvent.probe_result_id).where(IncidentEvent.incident_id == closed.incident_id)
        ).all()
    assert old_pass.result_id not in left
    assert open_leak.result_id in left, "an open incident keeps its evidence past expiry"
    assert closed.result_id not in left
    assert left == {open_leak.result_id, fresh_pass.result_id}
    assert removed == 1
    assert event_links == [None, None], "events outlive the results they pointed at"
