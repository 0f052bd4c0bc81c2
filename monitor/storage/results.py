"""Write the rows one probe run produces: its target (upserted) and its ``probe_result``.

The incident rules that follow live in ``monitor/incidents.py``; this module only turns a probe's
result into storable values (bounded text, plain JSON, finite numbers, an expiry).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from monitor.storage.db import as_utc
from monitor.storage.models import VERDICTS, Incident, ProbeResult, ProbeState, Target, public_url

if TYPE_CHECKING:
    from monitor.config import RetentionConfig
    from probes.base import ProbeResult as ProbeOutcome

REASON_CHARS = 64
DETAIL_CHARS = 2000
TITLE_CHARS = 200
# Integers beyond JSON's safe range are kept as text: PostgreSQL and JavaScript readers lose them.
_JSON_INT_LIMIT = 2**53
_MAX_DEPTH = 32
# probe_result's integer columns are 32-bit on PostgreSQL; a target's absurd count must not fail the row.
_INT32 = 2**31


def upsert_target(
    session: Session, *, name: str, engine: str, base_url: str, model: str, now: datetime
) -> int:
    """Return the id of target ``name``, inserting it or updating what changed.

    ``base_url`` is stored as :func:`public_url` (no credentials). The row is read first and
    written only on a change: an unchanged target takes no row lock, so replicas recording results
    for it do not queue behind each other. Concurrent first inserts are settled by the unique name.
    """
    base_url = public_url(base_url)
    query = select(Target.id, Target.engine, Target.base_url, Target.model).where(Target.name == name)
    row = session.execute(query).one_or_none()
    if row is None:
        dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
        values = dict(
            name=name, engine=engine, base_url=base_url, model=model, created_at=now, updated_at=now
        )
        session.execute(
            dialect.insert(Target).values(**values).on_conflict_do_nothing(index_elements=["name"])
        )
        row = session.execute(query).one()
    if (row.engine, row.base_url, row.model) != (engine, base_url, model):
        session.execute(
            update(Target)
            .where(Target.id == row.id)
            .values(engine=engine, base_url=base_url, model=model, updated_at=now)
        )
    return int(row.id)


def upsert_targets(
    session: Session, targets: Iterable[tuple[str, str, str, str]], now: datetime
) -> dict[str, int]:
    """Return the ids of ``(name, engine, base_url, model)`` targets by name, after one read of the
    table; only targets that are new or changed are written (:func:`upsert_target`)."""
    query = select(Target.name, Target.id, Target.engine, Target.base_url, Target.model)
    rows = {row.name: row for row in session.execute(query)}
    ids = {}
    for name, engine, base_url, model in targets:
        row = rows.get(name)
        if row is not None and (row.engine, row.base_url, row.model) == (engine, public_url(base_url), model):
            ids[name] = int(row.id)
        else:
            ids[name] = upsert_target(
                session, name=name, engine=engine, base_url=base_url, model=model, now=now
            )
    return ids


def save_state(
    session: Session, *, target_id: int, probe: str, node: str, state: dict[str, Any], now: datetime
) -> None:
    """Store what a probe carries to its next run on (target, node), replacing what was there."""
    values = dict(target_id=target_id, probe=probe, node=node, state=_jsonable(state), updated_at=now)
    session.execute(_state_upsert(session.get_bind().dialect.name), values)


@functools.cache
def _state_upsert(dialect_name: str) -> Any:
    """The upsert of a probe_state row, built once: ``excluded`` builds a column set each time."""
    dialect = postgresql if dialect_name == "postgresql" else sqlite
    stmt = dialect.insert(ProbeState)
    return stmt.on_conflict_do_update(
        index_elements=["target_id", "probe", "node"],
        set_={"state": stmt.excluded.state, "updated_at": stmt.excluded.updated_at},
    )


def load_state(session: Session, *, target: str, probe: str, node: str) -> dict[str, Any] | None:
    """Return the state a probe stored for (target, node), or None when it never stored one."""
    query = (
        select(ProbeState.state)
        .join(Target, Target.id == ProbeState.target_id)
        .where(Target.name == target, ProbeState.probe == probe, ProbeState.node == node)
    )
    state = session.execute(query).scalar_one_or_none()
    return dict(state) if isinstance(state, dict) else None


def load_states(session: Session) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Return every stored probe state by (target, probe, node): one read at start, not one per pair."""
    query = select(Target.name, ProbeState.probe, ProbeState.node, ProbeState.state).join(
        Target, Target.id == ProbeState.target_id
    )
    return {(t, p, n): dict(state) for t, p, n, state in session.execute(query) if isinstance(state, dict)}


def new_probe_result(
    *,
    probe: str,
    node: str = "",
    result: ProbeOutcome,
    started_at: datetime,
    duration_seconds: float,
    retention: RetentionConfig,
) -> ProbeResult:
    """Return an unsaved probe_result row for ``result``, without its ``target_id``.

    ``expires_at`` is ``started_at`` + ``retention.pass_days`` for a pass and
    ``retention.failure_days`` for anything else: failure evidence outlives success evidence.
    Raise ValueError for a verdict outside pass|leak|mismatch|error.
    """
    return ProbeResult(**probe_result_values(probe, node, result, started_at, duration_seconds, retention))


def probe_result_values(
    probe: str,
    node: str,
    result: ProbeOutcome,
    started_at: datetime,
    duration_seconds: float,
    retention: RetentionConfig,
) -> dict[str, Any]:
    """Return the column values of a probe_result row for ``result`` (see :func:`new_probe_result`)."""
    verdict = str(result.verdict)
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, not {verdict!r}")
    days = retention.pass_days if verdict == "pass" else retention.failure_days
    evidence = _jsonable(result.evidence)
    holds_excerpts = has_excerpts(evidence)
    return dict(
        probe=probe,
        node=node,
        verdict=verdict,
        reason=storable_text(result.reason)[:REASON_CHARS],
        detail=storable_text(result.detail)[:DETAIL_CHARS],
        started_at=started_at,
        duration_seconds=float(duration_seconds),
        evidence=evidence,
        incident_id=None,
        expires_at=started_at + timedelta(days=days),
        excerpts_until=started_at + timedelta(days=retention.excerpt_days) if holds_excerpts else None,
        **_measurements(result.measurements),
    )


def insert_rows(session: Session, rows: list[dict[str, Any]]) -> list[int]:
    """Insert probe_result rows given as column values, in one statement; return their ids in order.

    For results that change no incident (a pass while none is open): no ORM object, no flush per
    row. Most results are these.
    """
    if not rows:
        return []
    stmt = insert(ProbeResult).returning(ProbeResult.id, sort_by_parameter_order=True)
    return list(session.scalars(stmt, rows).all())


#: Evidence keys whose values are (redacted) text a target returned: ``excerpt``, ``baseline_excerpt``.
EXCERPT_SUFFIX = "excerpt"


def has_excerpts(value: Any) -> bool:
    """Return True when ``value`` (evidence, as plain JSON) holds any excerpt of target output."""
    if isinstance(value, dict):
        return any(
            (k.endswith(EXCERPT_SUFFIX) and v not in (None, "")) or has_excerpts(v) for k, v in value.items()
        )
    if isinstance(value, list):
        return any(has_excerpts(v) for v in value)
    return False


def without_excerpts(evidence: dict[str, Any], note: str) -> dict[str, Any]:
    """Return ``evidence`` with every excerpt set to null and ``excerpts_note`` saying why."""
    return {**_drop_excerpts(evidence), "excerpts_note": note}


def _drop_excerpts(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: None if k.endswith(EXCERPT_SUFFIX) else _drop_excerpts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_drop_excerpts(v) for v in value]
    return value


def purge_excerpts(session: Session, *, now: datetime, batch: int = 500) -> int:
    """Drop the excerpts of up to ``batch`` results whose ``excerpts_until`` has passed; return how many.

    The rows stay (verdict, reason, figures, marker ids and hashes): only the text goes.
    """
    rows = session.execute(
        select(ProbeResult.id, ProbeResult.evidence, ProbeResult.excerpts_until)
        .where(ProbeResult.excerpts_until.is_not(None), ProbeResult.excerpts_until <= as_utc(now))
        .limit(batch)
    ).all()
    for row_id, evidence, until in rows:
        note = f"excerpts purged on {as_utc(until).date().isoformat()} (retention.excerpt_days)"
        session.execute(
            update(ProbeResult)
            .where(ProbeResult.id == row_id)
            .values(evidence=without_excerpts(evidence, note), excerpts_until=None),
            execution_options={"synchronize_session": False},
        )
    return len(rows)


def prune_expired(session: Session, *, now: datetime, batch: int | None = None) -> int:
    """Delete probe_result rows whose ``expires_at`` has passed; return how many were deleted.

    With ``batch``, delete at most that many: the caller commits between batches, so a large
    backlog never holds SQLite's one write lock (or PostgreSQL row locks) for long.

    Rows linked to an incident that is still open are kept, whatever their expiry: an open incident
    keeps all its evidence. Once it is resolved each linked row lives until its own expiry (failures
    were given the longer ``failure_days``). Events that pointed at a deleted row keep their
    verdict and reason; their ``probe_result_id`` becomes NULL (ON DELETE SET NULL).
    """
    still_open = select(Incident.id).where(Incident.state == "open")
    due = (
        ProbeResult.expires_at <= as_utc(now),
        (ProbeResult.incident_id.is_(None)) | (ProbeResult.incident_id.not_in(still_open)),
    )
    stmt = delete(ProbeResult)
    if batch is None:
        stmt = stmt.where(*due)
    else:
        first = select(ProbeResult.id).where(*due).limit(batch).scalar_subquery()
        stmt = stmt.where(ProbeResult.id.in_(first))
    result = session.execute(stmt, execution_options={"synchronize_session": False})
    return int(result.rowcount)  # type: ignore[attr-defined]


def error_streak(
    session: Session, *, target_id: int, probe: str, node: str = "", until: datetime
) -> tuple[datetime, int]:
    """Return when the current run of errors of (target, probe, node) began and how many it holds.

    The run is every ``error`` result after the last judged (non-error) result, up to ``until``
    inclusive. With no error in that range, return (``until``, 1): the result being recorded.
    """
    mine = (
        ProbeResult.target_id == target_id,
        ProbeResult.probe == probe,
        ProbeResult.node == node,
        ProbeResult.started_at <= until,
    )
    last_judged = session.execute(
        select(func.max(ProbeResult.started_at)).where(*mine, ProbeResult.verdict != "error")
    ).scalar_one_or_none()
    streak = select(func.min(ProbeResult.started_at), func.count()).where(
        *mine, ProbeResult.verdict == "error"
    )
    if last_judged is not None:
        streak = streak.where(ProbeResult.started_at > last_judged)
    first, count = session.execute(streak).one()
    return (as_utc(first) if first is not None else until), max(int(count), 1)


def link_errors(
    session: Session,
    *,
    target_id: int,
    probe: str,
    node: str = "",
    incident_id: int,
    since: datetime,
    until: datetime,
) -> None:
    """Link the unlinked error results of (target, probe, node) started in [since, until] to an incident."""
    session.execute(
        update(ProbeResult)
        .where(
            ProbeResult.target_id == target_id,
            ProbeResult.probe == probe,
            ProbeResult.node == node,
            ProbeResult.verdict == "error",
            ProbeResult.started_at >= since,
            ProbeResult.started_at <= until,
            ProbeResult.incident_id.is_(None),
        )
        .values(incident_id=incident_id),
        execution_options={"synchronize_session": False},
    )


def _measurements(measurements: dict[str, float]) -> dict[str, Any]:
    """Pick the stored measurements; absent or non-finite ones become NULL."""

    def number(key: str) -> float | None:
        value = measurements.get(key)
        if value is None:
            return None
        try:
            value = float(value)
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None

    def integer(key: str) -> int | None:
        value = number(key)
        return int(value) if value is not None and abs(value) < _INT32 else None

    return {
        "latency_seconds": number("latency_seconds"),
        "ttft_seconds": number("ttft_seconds"),
        "status_code": integer("status_code"),
        "prompt_tokens_sent": integer("prompt_tokens_sent"),
        "prompt_tokens_reported": integer("prompt_tokens_reported"),
    }


def storable_text(value: str) -> str:
    """Return ``value`` as text every backend stores unchanged: NUL dropped, lone surrogates replaced.

    A target's answer can hold anything: PostgreSQL refuses NUL in text and ``\\u0000`` in JSON, and
    a lone surrogate (``"\\ud800"`` in a JSON string decodes to one) cannot be encoded as UTF-8 at all.
    """
    value = value.replace("\x00", "")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "replace").decode("utf-8")
    return value


def _plain(value: Any, depth: int = 0) -> Any:
    """Return ``value`` as plain JSON data: storable strings, finite numbers, nothing exotic.

    Work on the values, never on JSON text: editing escaped text breaks it (an answer holding the
    six characters ``\\u0000`` once made a leak unrecordable).
    """
    if isinstance(value, str):
        return storable_text(value)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) < _JSON_INT_LIMIT else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # NaN and inf are not JSON
    if depth >= _MAX_DEPTH:
        return storable_text(str(value))
    if isinstance(value, dict):
        return {storable_text(str(k)): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    return storable_text(str(value))  # a set, bytes, an object: its str()


def _jsonable(evidence: dict[str, Any]) -> dict[str, Any]:
    """Return ``evidence`` as plain JSON that both databases store the same way.

    A value JSON cannot hold (a set, bytes, NaN) becomes its ``str()``; text is made storable
    (:func:`storable_text`): a probe's odd value must not cost the recording of a leak.
    """
    plain = _plain(evidence or {})
    # Round-trip once: what is stored is exactly what a reader will get back.
    return dict(json.loads(json.dumps(plain)))


def incident_title(row: ProbeResult, target: str, severity: str, lasted: float | None = None) -> str:
    """Return a one-line title for an incident opened or escalated by ``row``, at most TITLE_CHARS:
    ``leak on glm-prod/cross_tenant: <detail>``; a ``warning`` says how long errors ``lasted``."""
    what = row.detail or row.reason
    where = f"{target}/{row.probe}" + (f" ({row.node})" if row.node else "")
    if severity == "warning":
        head = f"errors on {where}" + (f" for {int(lasted)}s" if lasted is not None else "")
        what = f"{row.reason}: {row.detail}" if row.detail else row.reason
    else:
        head = f"{row.verdict} on {where}"
    title = " ".join(f"{head}: {what}".split())
    return title if len(title) <= TITLE_CHARS else title[: TITLE_CHARS - 1] + "…"
