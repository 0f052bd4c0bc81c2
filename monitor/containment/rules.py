"""The quarantine rules: the deployments the gateways stop sending customers to, and why.

A target is quarantined while its latest ``quarantine_change`` row says so. The rules that add rows:

- **On, by an incident.** An open ``critical`` incident (a ``leak``, found by a probe or in traffic)
  that is ``certain``, or ``confirmed`` by an operator, quarantines its target, unless an operator
  lifted a quarantine after that incident opened (or was confirmed): an operator's lift holds until
  a new incident. A ``suspected`` one (a fingerprint check's hint, which customers sharing a public
  text can raise too) pages and is verified by probes, and moves no traffic unless the target's
  policy says ``suspected: quarantine``. Under the ``observe`` policy the row says
  ``enforced: false``: the gateways are told, count what they would have refused, and route as before.
- **Off, by recovery.** A quarantine an incident put on is lifted once no critical incident of the
  target is open and its last failure is ``lift_after_seconds`` old (an hour by default). An
  incident resolves after a few passes in a row, which a deployment leaking one request in four
  reaches about one time in two; an hour without any failure it does not reach, so it stays out.
- **By hand.** ``POST /api/v1/targets/{name}/quarantine`` puts one on (enforced whatever the
  policy: an operator asked), ``DELETE`` lifts it.

:meth:`QuarantineRules.sync` applies the first two rules (every second, and at once when a recording
changed an incident); every replica may run it: a target's rows are added under a lock of its
target row (PostgreSQL), and a rule that finds its row already added adds nothing.

Each row carries the ``revision`` the gateways' taps order sets by (:func:`next_revision`): above
every row's, and at least the time in milliseconds. Not the row's id: a database restored from a
backup hands its ids out again, below the sets the gateways hold, which they refuse as a rollback.
``GET /api/v1/quarantine`` serves the set to the gateways' taps (``docs/tap-protocol.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, or_, select, text
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.storage.models import Incident, IncidentEvent, QuarantineChange, Target

log = logging.getLogger("kvcanary.containment")

#: The severity of a leak's incident: what quarantines.
LEAK_SEVERITY = "critical"
REASON_CHARS = 300
#: The PostgreSQL advisory lock under which a change takes its revision ("kvcq" in ASCII).
REVISION_LOCK = 0x6B766371


@dataclass(frozen=True)
class Quarantine:
    """A target the gateways are told to stop sending customers to (``enforced``), or would be."""

    target: str
    enforced: bool
    cause: str
    incident_id: int | None
    reason: str
    since: datetime


@dataclass(frozen=True)
class QuarantineRead:
    """The set as one read of the rows found it, and the newest change's ``revision`` it was read
    at (0: none): a set's version, which the taps order sets by. Taken from that read alone, never
    from an earlier one: a database restored while the monitor runs then serves a lower revision,
    which the gateways refuse, not its older set numbered as the newer one they hold."""

    quarantines: list[Quarantine]
    revision: int


class UnknownTarget(LookupError):
    """No configured target has that name."""


class QuarantineRules:
    """Reads and changes the quarantine set; ``settings`` returns the settings in force."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        settings: Callable[[], Settings],
        on_change: Callable[[], None] | None = None,
    ):
        self.session_factory = session_factory
        self.settings = settings
        #: Called (from whichever thread made it) after a change: the pager re-sends at once.
        self.on_change = on_change
        #: The set as the last :meth:`sync` (or change by hand) read it: what ``/metrics`` exports
        #: and the bucket is offered without another read.
        self.last = QuarantineRead([], 0)

    @property
    def known(self) -> list[Quarantine]:
        return self.last.quarantines

    def current(self) -> list[Quarantine]:
        """Return every configured target that is quarantined now, enforced or observed."""
        return self.read().quarantines

    def read(self) -> QuarantineRead:
        """Return the set as the rows are now, with its revision."""
        with self.session_factory() as session:
            return self._read_from(_latest_changes(session))

    def _read_from(self, latest: dict[str, QuarantineChange]) -> QuarantineRead:
        names = {t.name for t in self.settings().targets}
        quarantines = [
            Quarantine(name, row.enforced, row.cause, row.incident_id, row.reason, row.at)
            for name, row in sorted(latest.items())
            if row.quarantined and name in names
        ]
        return QuarantineRead(quarantines, max((row.revision for row in latest.values()), default=0))

    def sync(self) -> list[Quarantine]:
        """Apply the incident and recovery rules to every target; return the changes made."""
        settings = self.settings()
        changes = []
        with self.session_factory() as session:  # two reads: most targets have nothing to change
            latest = _latest_changes(session)
            leaking = set(session.scalars(_OPEN_LEAK_TARGETS))
        for target in settings.targets:
            if target.name not in leaking and not (target.name in latest and latest[target.name].quarantined):
                continue
            with self.session_factory() as session, session.begin():
                row = _change_for(session, target, settings, datetime.now(UTC))
                if row is not None:
                    _add(session, row)
                    changes.append(_said(target.name, row))
        # The set as read above, unless a rule changed it (then read again: another replica may too).
        self.last = self.read() if changes else self._read_from(latest)
        if changes and self.on_change is not None:
            self.on_change()
        return changes

    def put(self, name: str, reason: str) -> Quarantine:
        """Quarantine ``name`` by hand (enforced); raise :class:`UnknownTarget`."""
        put = self._by_hand(name, reason, quarantined=True)
        assert put is not None  # a quarantine is always added
        return put

    def lift(self, name: str, reason: str) -> Quarantine | None:
        """Lift ``name``'s quarantine by hand; None when it had none. Raise :class:`UnknownTarget`."""
        return self._by_hand(name, reason, quarantined=False)

    def _by_hand(self, name: str, reason: str, *, quarantined: bool) -> Quarantine | None:
        if self.settings().target(name) is None:
            raise UnknownTarget(name)
        with self.session_factory() as session, session.begin():
            target_id = _locked_target_id(session, name)
            if target_id is None:
                raise UnknownTarget(name)
            last = _latest_of(session, target_id)
            if not quarantined and (last is None or not last.quarantined):
                return None
            row = QuarantineChange(
                target_id=target_id, at=datetime.now(UTC), quarantined=quarantined, enforced=True,
                cause="operator", incident_id=None, reason=reason[:REASON_CHARS],
            )  # fmt: skip
            _add(session, row)
        said = _said(name, row)
        log.warning("%s: %s by an operator: %s", name, "quarantined" if quarantined else "lifted", row.reason)
        self.last = self.read()
        if self.on_change is not None:
            self.on_change()
        return said


def changes_since(session: Session, target_name: str, since: datetime) -> list[QuarantineChange]:
    """Return the quarantine changes of ``target_name`` from ``since`` on, oldest first (at most 50):
    what an incident's page shows of what its leak did to the routing."""
    query = (
        select(QuarantineChange)
        .join(Target, Target.id == QuarantineChange.target_id)
        .where(Target.name == target_name, QuarantineChange.at >= since)
        .order_by(QuarantineChange.id)
        .limit(50)
    )
    return list(session.scalars(query))


def next_revision(session: Session, now: datetime) -> int:
    """Return the revision of a change added now: above every row's, and at least ``now`` in
    milliseconds. A database restored from a backup lacks the rows added since, but not their
    time: its next change is numbered above every set the monitors signed before the restore, and
    the gateways take it (until then they keep the newer set they hold: its quarantines are real).
    Above every row's, too, when a clock goes back."""
    if session.get_bind().dialect.name == "postgresql":
        # Replicas add changes of different targets at once; one at a time here, so that each
        # revision is above every one committed before it. Taken after the target's row lock,
        # and by nothing else, so the two are always taken in this order.
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": REVISION_LOCK})
    newest = session.scalar(select(func.max(QuarantineChange.revision))) or 0
    return max(newest + 1, int(now.timestamp() * 1000))


def _add(session: Session, row: QuarantineChange) -> None:
    row.revision = next_revision(session, row.at)
    session.add(row)


def _change_for(
    session: Session, target: TargetConfig, settings: Settings, now: datetime
) -> QuarantineChange | None:
    """Return the row the rules add for ``target`` now, or None (its state stands)."""
    target_id = _locked_target_id(session, target.name)
    if target_id is None:  # no result recorded yet: nothing can have opened an incident
        return None
    policy = settings.containment_of(target)
    enforced = policy.mode == "quarantine"
    hints = policy.suspected == "quarantine"
    last = _latest_of(session, target_id)
    leak = _open_leak(session, target_id, after=last.at if last is not None else None, hints=hints)
    if last is None or not last.quarantined:
        if leak is None:
            return None
        why = f"{leak.title} ({leak.certainty})"
        log.warning("%s: quarantine %s by incident %d: %s", target.name,
                    "on" if enforced else "observed", leak.id, why)  # fmt: skip
        return _row(target_id, now, True, enforced, "incident", leak.id, why)
    if last.cause != "incident":
        return None  # an operator's quarantine ends by hand
    if last.enforced != enforced and (told := _as_policy_says(session, last, enforced, hints, now)):
        return told  # the policy changed meanwhile: tell the gateways
    if _open_leak(session, target_id, after=None, hints=True) is not None:
        return None  # the deployment is still suspect: a hint keeps a quarantine on, never puts one on
    last_failure = session.scalar(
        select(func.max(Incident.last_failure_at)).where(Incident.target_id == target_id)
    )
    if last_failure is not None and now - last_failure < timedelta(seconds=policy.lift_after_seconds):
        return None
    reason = f"no failure for {policy.lift_after_seconds:g}s since incident {last.incident_id} resolved"
    log.warning("%s: quarantine lifted: %s", target.name, reason)
    return _row(target_id, now, False, last.enforced, "recovered", last.incident_id, reason)


def _as_policy_says(
    session: Session, last: QuarantineChange, enforced: bool, hints: bool, now: datetime
) -> QuarantineChange | None:
    """Return the row that tells the gateways a changed policy's word on ``last`` (an incident's
    quarantine), or None where it stays as it is. Enforcing takes what the policy now counts as
    proof: a quarantine a suspicion put on under ``suspected: quarantine`` stays observed under
    ``suspected: page`` until a leak is proven or confirmed."""
    target_id = last.target_id
    if not enforced:
        return _row(target_id, now, True, False, "incident", last.incident_id, last.reason)
    held_by = session.get(Incident, last.incident_id) if last.incident_id is not None else None
    if held_by is None or (held_by.certainty == "suspected" and not hints):
        held_by = _open_leak(session, target_id, after=None, hints=hints)
    if held_by is None:
        return None
    why = f"{held_by.title} ({held_by.certainty})"
    return _row(target_id, now, True, True, "incident", held_by.id, why)


def _row(
    target_id: int,
    at: datetime,
    quarantined: bool,
    enforced: bool,
    cause: str,
    incident_id: int | None,
    reason: str,
) -> QuarantineChange:
    return QuarantineChange(
        target_id=target_id, at=at, quarantined=quarantined, enforced=enforced, cause=cause,
        incident_id=incident_id, reason=reason[:REASON_CHARS],
    )  # fmt: skip


def _said(name: str, row: QuarantineChange) -> Quarantine:
    return Quarantine(name, row.enforced and row.quarantined, row.cause, row.incident_id, row.reason, row.at)


def _locked_target_id(session: Session, name: str) -> int | None:
    """Return the target's row id, locking the row (PostgreSQL) so replicas add changes one at a time."""
    return session.scalar(select(Target.id).where(Target.name == name).with_for_update())


def _latest_of(session: Session, target_id: int) -> QuarantineChange | None:
    query = select(QuarantineChange).where(QuarantineChange.target_id == target_id)
    return session.scalar(query.order_by(QuarantineChange.id.desc()).limit(1))


def _latest_changes(session: Session) -> dict[str, QuarantineChange]:
    """Return each target's latest change, by target name (one read of the index's last entries)."""
    newest = select(func.max(QuarantineChange.id)).group_by(QuarantineChange.target_id).scalar_subquery()
    rows = session.execute(
        select(Target.name, QuarantineChange)
        .join(Target, Target.id == QuarantineChange.target_id)
        .where(QuarantineChange.id.in_(newest))
    )
    return {name: row for name, row in rows}


#: The names of the targets with an open leak incident.
_OPEN_LEAK_TARGETS = (
    select(Target.name)
    .join(Incident, Incident.target_id == Target.id)
    .where(Incident.state == "open", Incident.severity == LEAK_SEVERITY)
    .distinct()
)


def _open_leak(session: Session, target_id: int, *, after: datetime | None, hints: bool) -> Incident | None:
    """Return the target's oldest open leak incident that is certain or confirmed (or, with
    ``hints``, suspected too), opened or confirmed after ``after`` when given."""
    query = select(Incident).where(
        Incident.target_id == target_id, Incident.state == "open", Incident.severity == LEAK_SEVERITY
    )
    if not hints:
        query = query.where(Incident.certainty != "suspected")
    if after is not None:
        confirmed_since = (
            select(IncidentEvent.id)
            .where(
                IncidentEvent.incident_id == Incident.id,
                IncidentEvent.kind == "confirmed",
                IncidentEvent.created_at > after,
            )
            .exists()
        )
        query = query.where(or_(Incident.opened_at > after, confirmed_since))
    return session.scalar(query.order_by(Incident.opened_at, Incident.id).limit(1))
