"""The quarantine rules (``monitor/containment/rules.py``) on SQLite and PostgreSQL: results recorded as
the runner records them, the rules applied as the monitor's sync does, the set read as the gateways
read it. ``kvcanary serve`` and the REST endpoints: ``tests/monitor/scenes/test_quarantine.py``."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.containment.rules import QuarantineRules, UnknownTarget
from kvcanary.monitor.incidents import confirm, dismiss
from kvcanary.monitor.storage.models import QuarantineChange
from tests.support.monitor_db import record

Factory = sessionmaker[Session]
TARGET = "glm-prod"


def settings(mode: str = "quarantine", lift_after_seconds: float = 3600, **target: Any) -> Settings:
    tenants = [{"name": "a"}, {"name": "b"}]
    targets = [
        {"name": TARGET, "base_url": "http://127.0.0.1:30000", "tenants": tenants, **target},
        {"name": "vllm-b", "base_url": "http://127.0.0.1:30001", "tenants": tenants},
    ]
    policy = {"mode": mode, "lift_after_seconds": lift_after_seconds}
    return Settings.model_validate({"targets": targets, "containment": policy})


def watch(factory: Factory, given: Settings) -> QuarantineRules:
    return QuarantineRules(factory, lambda: given)


def now(seconds: float = 0) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


def changes(factory: Factory) -> list[tuple[bool, bool, str]]:
    with factory() as s:
        rows = s.scalars(select(QuarantineChange).order_by(QuarantineChange.id))
        return [(row.quarantined, row.enforced, row.cause) for row in rows]


@pytest.mark.parametrize("mode", ["quarantine", "observe"])
def test_a_leak_quarantines_its_target_alone_and_observe_only_records_it(
    session_factory: Factory, mode: str
) -> None:
    containment = watch(session_factory, settings(mode))
    record(session_factory, "pass", at=now(-5), target="vllm-b")
    leak = record(session_factory, "leak", at=now(-2))
    made = containment.sync()
    assert [(q.target, q.enforced, q.cause, q.incident_id) for q in made] == [
        (TARGET, mode == "quarantine", "incident", leak.incident_id)
    ]
    assert containment.known == containment.current() and len(containment.known) == 1
    assert containment.sync() == []  # a rule that finds its row added adds nothing
    assert changes(session_factory) == [(True, mode == "quarantine", "incident")]


def test_a_mismatch_or_errors_quarantine_nothing(session_factory: Factory) -> None:
    containment = watch(session_factory, settings())
    record(session_factory, "mismatch", at=now(-2))
    record(session_factory, "error", at=now(-1), probe="canary")
    assert containment.sync() == [] and containment.current() == []


def test_an_operators_lift_holds_until_a_new_incident(session_factory: Factory) -> None:
    containment = watch(session_factory, settings())
    record(session_factory, "leak", at=now(-10))
    containment.sync()
    lifted = containment.lift(TARGET, "false alarm: the marker was our own")
    assert lifted is not None and lifted.cause == "operator" and not lifted.enforced
    record(session_factory, "leak", at=now(-5))  # the same incident, still open
    assert containment.sync() == [] and containment.current() == []
    assert containment.lift(TARGET, "again") is None  # nothing to lift
    record(session_factory, "leak", at=now(1), probe="canary")  # a new incident, after the lift
    assert [q.cause for q in containment.sync()] == ["incident"]


def test_recovery_lifts_a_quarantine_only_after_the_quiet_spell(session_factory: Factory) -> None:
    record(session_factory, "leak", at=now(-60))
    waiting = watch(session_factory, settings(lift_after_seconds=3600))
    waiting.sync()
    for i in range(3):  # resolve_after_passes: the incident resolves
        record(session_factory, "pass", at=now(-50 + i))
    assert waiting.sync() == [] and len(waiting.current()) == 1  # resolved, but not quiet for an hour
    done = watch(session_factory, settings(lift_after_seconds=30)).sync()
    assert [(q.cause, q.enforced) for q in done] == [("recovered", False)]
    assert changes(session_factory) == [(True, True, "incident"), (False, True, "recovered")]


def test_a_deployment_leaking_one_request_in_four_never_leaves_quarantine(session_factory: Factory) -> None:
    containment = watch(session_factory, settings(lift_after_seconds=600))
    quarantined = []
    start = now(-400)
    for i in range(40):  # ten resolutions in a row of passes, each followed by a leak
        record(session_factory, "leak" if i % 4 == 0 else "pass", at=start + timedelta(seconds=10 * i))
        containment.sync()
        quarantined.append(bool(containment.current()))
    assert all(quarantined)
    assert changes(session_factory) == [(True, True, "incident")]


def test_a_policy_changed_to_observe_tells_the_gateways_and_by_hand_is_always_enforced(
    session_factory: Factory,
) -> None:
    record(session_factory, "pass", at=now(-6), target="vllm-b")
    record(session_factory, "leak", at=now(-5))
    watch(session_factory, settings("quarantine")).sync()
    observing = watch(session_factory, settings("quarantine", containment={"mode": "observe"}))
    assert [q.enforced for q in observing.sync()] == [False]
    put = observing.put("vllm-b", "draining it for an upgrade")
    assert (put.target, put.enforced, put.cause) == ("vllm-b", True, "operator")
    assert {(q.target, q.enforced) for q in observing.current()} == {(TARGET, False), ("vllm-b", True)}
    with pytest.raises(UnknownTarget):
        observing.put("nope", "typo")


# --- certain and suspected ----------------------------------------------------------------------------


def suspected(factory: Factory, at: datetime) -> int:
    """Record a fingerprint check's suspected leak; return its incident's id."""
    opened = record(factory, "leak", at=at, probe="traffic_overlap", certainty="suspected")
    assert opened.incident_id is not None
    return opened.incident_id


def test_a_suspected_leak_quarantines_nothing_until_an_operator_confirms_it(session_factory: Factory) -> None:
    containment = watch(session_factory, settings())
    incident_id = suspected(session_factory, now(-5))
    assert containment.sync() == [] and containment.current() == []
    with session_factory() as s, s.begin():
        confirm(s, incident_id=incident_id, note="a private contract, confirmed", now=now())
    made = containment.sync()
    assert [(q.cause, q.incident_id, q.enforced) for q in made] == [("incident", incident_id, True)]
    assert made[0].reason.endswith("(confirmed)")


def test_a_target_whose_policy_says_suspected_quarantine_acts_on_a_hint(session_factory: Factory) -> None:
    strict = settings(containment={"suspected": "quarantine"})
    incident_id = suspected(session_factory, now(-5))
    made = watch(session_factory, strict).sync()
    assert [(q.target, q.incident_id) for q in made] == [(TARGET, incident_id)]
    assert made[0].reason.endswith("(suspected)")


def test_a_certain_leak_beside_a_suspected_one_quarantines_at_once(session_factory: Factory) -> None:
    containment = watch(session_factory, settings())
    suspected(session_factory, now(-5))
    proof = record(session_factory, "leak", at=now(-1), probe="cross_tenant")
    assert [q.incident_id for q in containment.sync()] == [proof.incident_id]


def test_a_confirmation_after_an_operators_lift_quarantines_again(session_factory: Factory) -> None:
    containment = watch(session_factory, settings(containment={"suspected": "quarantine"}))
    incident_id = suspected(session_factory, now(-10))
    containment.sync()
    assert containment.lift(TARGET, "looks like a licence text") is not None
    assert containment.sync() == []  # the lift holds over the hint
    with session_factory() as s, s.begin():
        confirm(s, incident_id=incident_id, note="it is not: confirmed", now=now(1))
    assert [q.incident_id for q in containment.sync()] == [incident_id]


def test_a_suspicion_keeps_a_quarantine_on_but_a_dismissed_one_lets_recovery_lift_it(
    session_factory: Factory,
) -> None:
    containment = watch(session_factory, settings(lift_after_seconds=30))
    record(session_factory, "leak", at=now(-120))
    assert len(containment.sync()) == 1
    for i in range(3):  # the certain incident resolves
        record(session_factory, "pass", at=now(-110 + i))
    incident_id = suspected(session_factory, now(-100))
    assert containment.sync() == [] and len(containment.current()) == 1  # still suspect: kept out
    with session_factory() as s, s.begin():
        dismiss(s, incident_id=incident_id, note="a public text", now=now(-50))
    assert [q.cause for q in containment.sync()] == ["recovered"]


def test_enforcing_a_quarantine_a_suspicion_put_on_waits_for_what_the_new_policy_counts_as_proof(
    session_factory: Factory,
) -> None:
    hints_observed = settings("observe", containment={"suspected": "quarantine"})
    incident_id = suspected(session_factory, now(-10))
    assert [q.enforced for q in watch(session_factory, hints_observed).sync()] == [False]
    enforcing = watch(session_factory, settings("quarantine", containment={"suspected": "page"}))
    assert enforcing.sync() == [] and [q.enforced for q in enforcing.current()] == [False]
    assert changes(session_factory) == [(True, False, "incident")]
    with session_factory() as s, s.begin():
        confirm(s, incident_id=incident_id, note="a private contract, confirmed", now=now())
    made = enforcing.sync()
    assert [(q.incident_id, q.enforced) for q in made] == [(incident_id, True)]
    assert made[0].reason.endswith("(confirmed)")


def test_enforcing_a_quarantine_a_proof_put_on_tells_the_gateways_at_once(session_factory: Factory) -> None:
    proof = record(session_factory, "leak", at=now(-5))
    watch(session_factory, settings("observe")).sync()
    made = watch(session_factory, settings("quarantine")).sync()
    assert [(q.incident_id, q.enforced) for q in made] == [(proof.incident_id, True)]


def revisions(factory: Factory) -> list[int]:
    with factory() as s:
        return list(s.scalars(select(QuarantineChange.revision).order_by(QuarantineChange.id)))


def test_a_database_restored_from_a_backup_numbers_its_next_change_above_every_set_signed_since(
    session_factory: Factory,
) -> None:
    record(session_factory, "pass", at=now(-5))
    before = watch(session_factory, settings())
    before.put(TARGET, "taken out for maintenance")
    backed_up = before.last.revision
    for turn in range(2):  # the changes after the backup, each served to the gateways
        before.lift(TARGET, f"back {turn}")
        before.put(TARGET, f"out {turn}")
    signed = before.last.revision
    assert revisions(session_factory) == sorted(set(revisions(session_factory)))
    with session_factory() as s, s.begin():  # the restore: the rows after the backup are gone
        s.query(QuarantineChange).filter(QuarantineChange.revision > backed_up).delete()
        if s.get_bind().dialect.name == "postgresql":  # and the ids hand out as the backup had them
            s.execute(text("SELECT setval(pg_get_serial_sequence('quarantine_change', 'id'), "
                           "(SELECT max(id) FROM quarantine_change))"))  # fmt: skip
    for monitor in (before, watch(session_factory, settings())):  # running through it, or restarted
        read = monitor.read()
        assert read.quarantines and read.revision == backed_up < signed  # the gateways keep theirs
    time.sleep(0.01)  # a restore takes longer than this
    before.lift(TARGET, "lifted after the restore")
    assert before.last.revision > signed  # a gateway takes it
    assert before.current() == []


def test_a_change_is_numbered_above_one_a_clock_ahead_numbered(session_factory: Factory) -> None:
    record(session_factory, "pass", at=now(-5))
    containment = watch(session_factory, settings())
    containment.put(TARGET, "out")
    ahead = int(now(3600).timestamp() * 1000)  # a replica whose clock ran an hour ahead
    with session_factory() as s, s.begin():
        s.query(QuarantineChange).update({QuarantineChange.revision: ahead})
    containment.lift(TARGET, "back")
    assert revisions(session_factory) == [ahead, ahead + 1]
    assert containment.last.revision == ahead + 1


def test_replicas_changing_two_targets_at_once_number_their_changes_in_the_order_they_land(
    session_factory: Factory,
) -> None:
    record(session_factory, "pass", at=now(-5))
    record(session_factory, "pass", at=now(-5), target="vllm-b")

    def toggle(name: str) -> None:
        replica = watch(session_factory, settings())  # its own rules, as another replica has
        for turn in range(15):
            replica.put(name, f"out {turn}")
            replica.lift(name, f"back {turn}")

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(toggle, [TARGET, "vllm-b"]))
    found = revisions(session_factory)
    assert len(found) == 60 and found == sorted(set(found)), found
