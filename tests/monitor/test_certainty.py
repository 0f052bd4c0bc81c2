"""How each finding is known (``probes/base.py``: certain or suspected) through the incident
lifecycle (``monitor/incidents.py``), on SQLite and PostgreSQL: a suspected incident proven by a
certain failure, confirmed or dismissed by an operator, and what each of those pages."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.incidents import NotSuspected, confirm, dismiss
from kvcanary.monitor.storage.models import Incident, IncidentEvent, ProbeResultRow
from tests.support.monitor_db import minutes, record

Factory = sessionmaker[Session]
OVERLAP = "traffic_overlap"


def incident(factory: Factory, incident_id: int) -> tuple[str, str]:
    with factory() as s:
        row = s.get(Incident, incident_id)
        assert row is not None
        return row.state, row.certainty


def events(factory: Factory, incident_id: int) -> list[tuple[str, str | None, str | None]]:
    with factory() as s:
        rows = s.scalars(
            select(IncidentEvent).where(IncidentEvent.incident_id == incident_id).order_by(IncidentEvent.id)
        )
        return [(e.kind, e.note, None if e.processed_at is None else "delivered") for e in rows]


def test_a_suspected_leak_opens_a_suspected_incident_and_its_result_says_so(session_factory: Factory) -> None:
    opened = record(session_factory, "leak", at=minutes(0), probe=OVERLAP, certainty="suspected")
    assert opened.change == "opened" and opened.incident_id is not None
    assert incident(session_factory, opened.incident_id) == ("open", "suspected")
    passed = record(session_factory, "pass", at=minutes(1), probe="canary")
    with session_factory() as s:
        rows = {r.id: r.certainty for r in s.scalars(select(ProbeResultRow))}
    assert rows == {opened.result_id: "suspected", passed.result_id: None}  # a pass has no certainty


def test_a_certain_failure_proves_a_suspected_incident_once_and_a_suspected_one_never_lowers_it(
    session_factory: Factory,
) -> None:
    opened = record(session_factory, "leak", at=minutes(0), probe=OVERLAP, certainty="suspected")
    assert opened.incident_id is not None
    again = record(session_factory, "leak", at=minutes(1), probe=OVERLAP, certainty="suspected")
    assert again.change == "attached" and incident(session_factory, opened.incident_id)[1] == "suspected"
    proof = record(session_factory, "leak", at=minutes(2), probe=OVERLAP, reason="foreign_marker")
    assert (proof.change, proof.incident_id) == ("proven", opened.incident_id)
    later = record(session_factory, "leak", at=minutes(3), probe=OVERLAP, certainty="suspected")
    assert later.change == "attached"
    assert incident(session_factory, opened.incident_id) == ("open", "certain")
    kinds = [kind for kind, _, _ in events(session_factory, opened.incident_id)]
    assert kinds.count("proven") == 1


def test_a_proof_that_also_escalates_is_told_as_the_escalation(session_factory: Factory) -> None:
    opened = record(session_factory, "mismatch", at=minutes(0), probe=OVERLAP, certainty="suspected")
    assert opened.incident_id is not None
    proof = record(session_factory, "leak", at=minutes(1), probe=OVERLAP)
    assert proof.change == "escalated"
    kinds = [kind for kind, _, _ in events(session_factory, opened.incident_id)]
    assert kinds == ["opened", "proven", "escalated"]
    assert incident(session_factory, opened.incident_id) == ("open", "certain")


def test_an_operator_confirms_a_suspected_incident_and_the_confirmation_pages(
    session_factory: Factory,
) -> None:
    opened = record(session_factory, "leak", at=minutes(0), probe=OVERLAP, certainty="suspected")
    assert opened.incident_id is not None
    with session_factory() as s, s.begin():
        confirm(s, incident_id=opened.incident_id, note="a contract draft, not public", now=minutes(2))
    assert incident(session_factory, opened.incident_id) == ("open", "confirmed")
    assert events(session_factory, opened.incident_id)[-1] == (
        "confirmed", "a contract draft, not public", None
    )  # fmt: skip
    with pytest.raises(NotSuspected) as twice, session_factory() as s, s.begin():
        confirm(s, incident_id=opened.incident_id, note="again", now=minutes(3))
    assert (twice.value.state, twice.value.certainty) == ("open", "confirmed")


def test_an_operator_dismisses_a_suspected_incident_as_benign_and_it_resolves(
    session_factory: Factory,
) -> None:
    opened = record(session_factory, "leak", at=minutes(0), probe=OVERLAP, certainty="suspected")
    assert opened.incident_id is not None
    with session_factory() as s, s.begin():
        dismiss(s, incident_id=opened.incident_id, note="the Gettysburg Address", now=minutes(2))
    assert incident(session_factory, opened.incident_id) == ("resolved", "suspected")
    assert events(session_factory, opened.incident_id)[-1] == ("dismissed", "the Gettysburg Address", None)
    again = record(session_factory, "leak", at=minutes(3), probe=OVERLAP, certainty="suspected")
    assert again.change == "opened" and again.incident_id != opened.incident_id


@pytest.mark.parametrize("act", [confirm, dismiss])
def test_an_operators_word_never_applies_to_a_certain_or_unknown_incident(
    session_factory: Factory, act: object
) -> None:
    certain = record(session_factory, "leak", at=minutes(0))
    assert certain.incident_id is not None
    for incident_id, said in ((certain.incident_id, ("open", "certain")), (10_000, (None, None))):
        with pytest.raises(NotSuspected) as refused, session_factory() as s, s.begin():
            act(s, incident_id=incident_id, note="no", now=minutes(1) + timedelta(seconds=1))  # type: ignore[operator]
        assert (refused.value.state, refused.value.certainty) == said
    assert incident(session_factory, certain.incident_id) == ("open", "certain")
