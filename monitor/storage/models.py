"""The tables: what was probed (``target``), what each probe run concluded (``probe_result``), the
incidents those results open and resolve (``incident``), every state change of an incident as a
row (``incident_event``, also the paging outbox), and what a probe carries from one run to the next
(``probe_state``: counter readings, baselines, configuration fingerprints).

``node`` names the serving node a result or incident is about (``prefill-0``); it is the empty
string for probes that judge the target as a whole.

The schema itself is created only by ``migrations/``; ``tests/monitor/storage/test_migrations.py`` checks
that the migrations and these models agree on SQLite and PostgreSQL. Relationships are
``lazy="raise"``: a query says what it loads, so no request quietly issues one query per row.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, get_args
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from kvcanary.monitor.storage.db import Base, UTCDateTime

Verdict = Literal["pass", "leak", "mismatch", "error"]
#: A traffic record's verdicts: a probe's, and ``refused``, a request the gateway refused before any
#: upstream call (its admission guard, its quarantine): kept and counted, never an incident's cause.
TrafficVerdict = Literal["pass", "leak", "mismatch", "error", "refused"]
Severity = Literal["critical", "high", "warning"]
State = Literal["open", "resolved"]
#: ``proven``: a certain finding joined a suspected incident; ``confirmed`` and ``dismissed``: an
#: operator's word on a suspected one; ``verification``: the probes run to check a suspicion ended.
EventKind = Literal[
    "opened", "escalated", "resolved", "failure", "config_changed",
    "proven", "confirmed", "dismissed", "verification",
]  # fmt: skip
#: How a failure is known (``probes/base.py``); an incident may also be ``confirmed`` by an operator.
ResultCertainty = Literal["certain", "suspected"]
IncidentCertainty = Literal["certain", "suspected", "confirmed"]
#: Who or what changed a target's quarantine: an incident, its lifting rule, or an operator.
QuarantineCause = Literal["incident", "recovered", "operator"]

VERDICTS: tuple[str, ...] = get_args(Verdict)
TRAFFIC_VERDICTS: tuple[str, ...] = get_args(TrafficVerdict)
#: Worst first; an incident's severity only ever moves towards the front.
SEVERITIES: tuple[str, ...] = get_args(Severity)
STATES: tuple[str, ...] = get_args(State)
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
QUARANTINE_CAUSES: tuple[str, ...] = get_args(QuarantineCause)
RESULT_CERTAINTIES: tuple[str, ...] = get_args(ResultCertainty)
INCIDENT_CERTAINTIES: tuple[str, ...] = get_args(IncidentCertainty)


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def public_url(url: str) -> str:
    """Return ``url`` without credentials or query string: the only form stored or served.

    ``https://user:key@host/v1?api_key=k`` becomes ``https://host/v1``.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class Target(Base):
    """A serving endpoint as last configured. Rows are upserted by name as results arrive."""

    __tablename__ = "target"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    engine: Mapped[str] = mapped_column(String(32))
    # Always public_url(): never credentials.
    base_url: Mapped[str] = mapped_column(String(2048))
    model: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Last time engine, base_url or model changed (not the last result).
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ProbeResultRow(Base):
    """One probe run's verdict and measurements. ``evidence`` is already redacted by the probe.

    ``incident_id`` is the incident that was open for (target, probe) when the result was
    recorded, whatever the verdict (the failures it counted, the errors and passes in between).
    ``expires_at`` is when :func:`monitor.incidents.prune_expired` may delete the row: failures
    are kept longer than passes.
    """

    __tablename__ = "probe_result"
    __table_args__ = (
        CheckConstraint(_one_of("verdict", VERDICTS), name="verdict"),
        CheckConstraint(_one_of("certainty", RESULT_CERTAINTIES), name="certainty"),
        # The results list is newest first with id breaking ties, paged by keyset on (started_at, id).
        # Each index below leads with the equality filters of one kind of page and ends in
        # (started_at, id), so such a page is an ordered index range that stops after `limit` rows
        # instead of a sort of everything matching. monitor.storage.queries.PROBE_RESULT_SCANS
        # lists them in the order it prefers them; other filters are applied to what they yield.
        Index("ix_probe_result_started_id", "started_at", "id"),
        Index("ix_probe_result_verdict_started_id", "verdict", "started_at", "id"),
        Index("ix_probe_result_target_started_id", "target_id", "started_at", "id"),
        Index("ix_probe_result_target_verdict_started_id", "target_id", "verdict", "started_at", "id"),
        # Also the last verdict of each (target, probe) (one index probe per pair) and error streaks.
        Index("ix_probe_result_target_probe_started_id", "target_id", "probe", "started_at", "id"),
        # An incident's most recent linked results; also what pruning and ON DELETE SET NULL look up.
        Index("ix_probe_result_incident_started_id", "incident_id", "started_at", "id"),
        Index("ix_probe_result_expires_at", "expires_at"),
        # Rows still holding excerpts of target output, by when those must go (retention.excerpt_days).
        Index(
            "ix_probe_result_excerpts_until",
            "excerpts_until",
            sqlite_where=text("excerpts_until IS NOT NULL"),
            postgresql_where=text("excerpts_until IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    target_id: Mapped[int] = mapped_column(ForeignKey("target.id"))
    probe: Mapped[str] = mapped_column(String(64))
    node: Mapped[str] = mapped_column(String(63), server_default="")
    verdict: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    duration_seconds: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer)
    latency_seconds: Mapped[float | None] = mapped_column(Float)
    ttft_seconds: Mapped[float | None] = mapped_column(Float)
    prompt_tokens_sent: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens_reported: Mapped[int | None] = mapped_column(Integer)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON)
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incident.id", ondelete="SET NULL"))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # When the excerpts in ``evidence`` (another customer's text, perhaps) are purged; NULL: none held.
    excerpts_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # How a leak or mismatch is known (certain, suspected); NULL for a pass or an error.
    certainty: Mapped[str | None] = mapped_column(String(16))

    target: Mapped[Target] = relationship(lazy="raise")


class Incident(Base):
    """A failing (target, probe): opened by a leak, a mismatch or lasting errors; resolved by passes.

    ``state`` and ``severity`` change only through compare-and-set UPDATEs in
    ``monitor/incidents.py``, and every change writes an :class:`IncidentEvent`.
    """

    __tablename__ = "incident"
    __table_args__ = (
        CheckConstraint(_one_of("severity", SEVERITIES), name="severity"),
        CheckConstraint(_one_of("state", STATES), name="state"),
        CheckConstraint(_one_of("certainty", INCIDENT_CERTAINTIES), name="certainty"),
        # At most one open incident per (target, probe, node), enforced by the database so that it
        # also holds across monitor replicas. monitor.storage.incident_rows.try_open relies on it: the replica
        # whose INSERT fails with IntegrityError rolls back to its SAVEPOINT and attaches instead.
        Index(
            "uq_incident_open_target_probe_node",
            "target_id",
            "probe",
            "node",
            unique=True,
            sqlite_where=text("state = 'open'"),
            postgresql_where=text("state = 'open'"),
        ),
        # The incidents list, as for probe_result: equality filters first, then the keyset
        # (opened_at, id); monitor.storage.queries.INCIDENT_SCANS names them.
        Index("ix_incident_opened_id", "opened_at", "id"),
        Index("ix_incident_state_opened_id", "state", "opened_at", "id"),
        Index("ix_incident_target_opened_id", "target_id", "opened_at", "id"),
        Index("ix_incident_target_state_opened_id", "target_id", "state", "opened_at", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    target_id: Mapped[int] = mapped_column(ForeignKey("target.id"))
    probe: Mapped[str] = mapped_column(String(64))
    node: Mapped[str] = mapped_column(String(63), server_default="")
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    title: Mapped[str] = mapped_column(String(200))
    opened_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # started_at of the latest result that counted against this incident.
    last_failure_at: Mapped[datetime] = mapped_column(UTCDateTime())
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # When (target, probe, node) last passed before the failure that opened this incident: where a
    # blast radius starts when nothing narrower is known (passes themselves are pruned in a week).
    last_pass_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    failure_count: Mapped[int] = mapped_column(Integer)
    consecutive_passes: Mapped[int] = mapped_column(Integer)
    last_verdict: Mapped[str] = mapped_column(String(16))
    last_reason: Mapped[str] = mapped_column(String(64))
    # How its failures are known: ``certain`` once any is (containment acts on it), ``suspected``
    # while none is, ``confirmed`` where an operator said a suspected one is real. Only moves up.
    certainty: Mapped[str] = mapped_column(String(16), server_default="certain")

    target: Mapped[Target] = relationship(lazy="raise")
    events: Mapped[list[IncidentEvent]] = relationship(
        lazy="raise", back_populates="incident", order_by="[IncidentEvent.created_at, IncidentEvent.id]"
    )


class IncidentEvent(Base):
    """One change in an incident's life: opened, escalated, resolved, or a notable failure.

    The table doubles as the paging outbox (``monitor/paging/pager.py``): ``processed_at`` is NULL
    until an Alertmanager accepted the event. A pager claims a batch by compare-and-set
    (``UPDATE … SET claimed_by=:me, claimed_until=:lease WHERE id IN (…) AND processed_at IS NULL
    AND (claimed_until IS NULL OR claimed_until < :now)``), so two replicas never deliver one event
    twice, and a claim that its pager did not live to finish lapses after the lease.
    """

    __tablename__ = "incident_event"
    __table_args__ = (
        CheckConstraint(_one_of("kind", EVENT_KINDS), name="kind"),
        Index("ix_incident_event_incident_created", "incident_id", "created_at"),
        # The pager polls for unprocessed events; the partial index keeps that scan as small as the
        # backlog instead of the whole history.
        Index(
            "ix_incident_event_unprocessed",
            "created_at",
            sqlite_where=text("processed_at IS NULL"),
            postgresql_where=text("processed_at IS NULL"),
        ),
        # Pruning a probe_result sets the events that point at it to NULL: without this index each
        # deleted row scans the whole event table.
        Index("ix_incident_event_probe_result_id", "probe_result_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    incident_id: Mapped[int] = mapped_column(ForeignKey("incident.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    kind: Mapped[str] = mapped_column(String(16))
    old_state: Mapped[str | None] = mapped_column(String(16))
    new_state: Mapped[str] = mapped_column(String(16))
    old_severity: Mapped[str | None] = mapped_column(String(16))
    new_severity: Mapped[str] = mapped_column(String(16))
    verdict: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(64))
    # Pruning a result keeps the event: the link just goes NULL.
    probe_result_id: Mapped[int | None] = mapped_column(ForeignKey("probe_result.id", ondelete="SET NULL"))
    processed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Delivery bookkeeping of the pager: who holds the event, until when, how many tries, why the last failed.
    claimed_by: Mapped[str | None] = mapped_column(String(64))
    claimed_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    last_error: Mapped[str | None] = mapped_column(String(200))
    # What an operator said (a confirmation, a dismissal) or what a verification ran and found.
    note: Mapped[str | None] = mapped_column(String(300))

    incident: Mapped[Incident] = relationship(lazy="raise", back_populates="events")


class ProbeState(Base):
    """What a probe of one (target, node) carries to its next run, as one JSON document.

    The runner loads it before a run and stores the probe's new state in the same transaction as
    the run's result: the counters probe keeps its last readings here, so an increase is judged
    between reads across restarts and across replicas.
    """

    __tablename__ = "probe_state"
    __table_args__ = (UniqueConstraint("target_id", "probe", "node"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    target_id: Mapped[int] = mapped_column(ForeignKey("target.id", ondelete="CASCADE"))
    probe: Mapped[str] = mapped_column(String(64))
    node: Mapped[str] = mapped_column(String(63))
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class MonitorReplica(Base):
    """A ``kvcanary serve`` process sharing the database; its heartbeat says it is alive.

    Replicas divide the (target, probe) work by rendezvous hashing over the live rows
    (``monitor/runs/replicas.py``): each pair is run by the live replica with the highest hash of
    (replica, pair), so every replica agrees without talking to the others, and a replica whose
    heartbeat stops loses its pairs to the survivors within one lease.
    """

    __tablename__ = "monitor_replica"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    # Where the other replicas reach this one (its API): gateway traffic is handed to its owner.
    url: Mapped[str] = mapped_column(String(2048), server_default="")
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime())


#: What a blast radius reads of a kept traffic record (``monitor/blast/recorded.py``).
BLAST_COLUMNS = ["node", "caller", "status_code", "estimated_prompt_tokens", "own", "key_hash", "checks"]


class TrafficRecordRow(Base):
    """A gateway traffic record kept for later (``monitor/traffic/``): every record a check flagged,
    and every record whose prompt was near or over its node's pool (what a blast radius reads).

    No text and no fingerprint: sizes, usage, timings, the caller as the gateway named it, and
    what each check found. ``checks`` lists the flagged checks as ``,capacity,overlap,`` (so a
    filter is one LIKE); ``findings`` holds each flagged check's reason and figures.
    """

    __tablename__ = "traffic_record"
    __table_args__ = (
        CheckConstraint(_one_of("verdict", TRAFFIC_VERDICTS), name="verdict"),
        Index("ix_traffic_record_started_id", "started_at", "id"),
        # Also a blast radius's range (a target's window), which on PostgreSQL it reads from the
        # index alone: the columns its criteria and groups need are included.
        Index(
            "ix_traffic_record_target_started_id",
            "target_id",
            "started_at",
            "id",
            postgresql_include=BLAST_COLUMNS,
        ),
        Index("ix_traffic_record_verdict_started_id", "verdict", "started_at", "id"),
        Index("ix_traffic_record_caller_started_id", "caller", "started_at", "id"),
        Index("ix_traffic_record_expires_at", "expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    target_id: Mapped[int] = mapped_column(ForeignKey("target.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(63), server_default="")
    gateway: Mapped[str] = mapped_column(String(64), server_default="")
    # The record's identity (the tap's, one per exchange; an older tap's record: the gateway's id).
    request_id: Mapped[str] = mapped_column(String(200))
    # The gateway's id of the response (the engine's: what the customer got), "" where it gave none.
    # Data, not identity: engines repeat it, so two rows may share it.
    upstream_id: Mapped[str] = mapped_column(String(200), server_default="")
    caller: Mapped[str] = mapped_column(String(200))
    caller_kind: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(128), server_default="")
    model: Mapped[str] = mapped_column(String(200), server_default="")
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    received_at: Mapped[datetime] = mapped_column(UTCDateTime())
    status_code: Mapped[int] = mapped_column(Integer)
    stream: Mapped[bool] = mapped_column(Boolean)
    finish_reason: Mapped[str | None] = mapped_column(String(200))
    latency_seconds: Mapped[float | None] = mapped_column(Float)
    ttft_seconds: Mapped[float | None] = mapped_column(Float)
    prompt_chars: Mapped[int] = mapped_column(BigInteger)
    prompt_bytes: Mapped[int] = mapped_column(BigInteger)
    prompt_messages: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    completion_tokens: Mapped[int | None] = mapped_column(BigInteger)
    cached_tokens: Mapped[int | None] = mapped_column(BigInteger)
    estimated_prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    kv_pool_tokens: Mapped[int | None] = mapped_column(BigInteger)
    verdict: Mapped[str] = mapped_column(String(16))
    # A record of one of the monitor's own tenants: not judged, kept for the blast radius to exclude.
    own: Mapped[bool] = mapped_column(Boolean, server_default=false())
    checks: Mapped[str] = mapped_column(String(64), server_default="")
    findings: Mapped[dict[str, Any]] = mapped_column(JSON)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())

    target: Mapped[Target] = relationship(lazy="raise")


class TrafficMinute(Base):
    """Per-minute counts of the traffic not kept as rows, per (target, node, caller)."""

    __tablename__ = "traffic_minute"
    __table_args__ = (
        UniqueConstraint("target_id", "node", "caller", "minute"),
        Index("ix_traffic_minute_minute", "minute"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    target_id: Mapped[int] = mapped_column(ForeignKey("target.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(63))
    caller: Mapped[str] = mapped_column(String(200))
    minute: Mapped[datetime] = mapped_column(UTCDateTime())
    records: Mapped[int] = mapped_column(Integer)
    answered: Mapped[int] = mapped_column(Integer)  # 2xx
    flagged: Mapped[int] = mapped_column(Integer)
    near_pool: Mapped[int] = mapped_column(Integer)
    # Of ``answered``, how many were the monitor's own tenants' (excluded from a blast radius).
    own: Mapped[int] = mapped_column(Integer, server_default="0")
    max_prompt_chars: Mapped[int] = mapped_column(BigInteger)


class TrafficJudged(Base):
    """A record id (the tap's, one per exchange: never the engine's response id, which repeats)
    judged from the JetStream stream (``monitor/traffic/jetstream.py``), written in
    the transaction that stores what judging it found: a redelivered message (its replica died
    before the acknowledgement, or the acknowledgement was lost) or a tap's late resend finds its
    id here and is acknowledged without being judged again. Kept twice the stream's duplicate
    window (``traffic.jetstream.duplicate_window_seconds``), so the table stays as small as what
    can still come again, not as the stream."""

    __tablename__ = "traffic_judged"
    __table_args__ = (Index("ix_traffic_judged_judged_at", "judged_at"),)

    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    record_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    judged_at: Mapped[datetime] = mapped_column(UTCDateTime())


class QuarantineChange(Base):
    """One change of a target's quarantine: put on (by an incident or an operator) or lifted (by the
    lifting rule or an operator). Rows are only added; a target's state is its latest row's
    (``monitor/containment/rules.py``), so a restarted monitor or another replica reads the same set.

    ``enforced`` is False for a quarantine the ``observe`` policy only records: the gateways are
    told of it and route as before. ``revision`` numbers the change for the gateways' taps, which
    take only a set numbered above the one they hold: above every row's, and at least the time in
    milliseconds, so that a database restored from a backup numbers its next change above every set
    the monitors signed before it (``rules.next_revision``).
    """

    __tablename__ = "quarantine_change"
    __table_args__ = (
        CheckConstraint(_one_of("cause", QUARANTINE_CAUSES), name="cause"),
        Index("ix_quarantine_change_target_id", "target_id", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    target_id: Mapped[int] = mapped_column(ForeignKey("target.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    quarantined: Mapped[bool] = mapped_column(Boolean)
    enforced: Mapped[bool] = mapped_column(Boolean)
    cause: Mapped[str] = mapped_column(String(16))
    # The incident that put the quarantine on (and, on a lift by the rule, the one it ends).
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incident.id", ondelete="SET NULL"))
    # One line: the incident's title, or what the operator wrote.
    reason: Mapped[str] = mapped_column(String(300))
    revision: Mapped[int] = mapped_column(BigInteger)
