"""Record every probe result: in the database when it answers, in the spool when it does not.

:class:`Recorder` is the runner's only way to the database. Its promise: a verdict is either in the
database, or in the :class:`~monitor.recording.spool.Spool` waiting to be replayed in order, or counted as
dropped (the spool was full of worse news). Two kinds of failure are told apart:

- **unavailable** (the server is down, a connection broke, a lock timed out): the result is spooled
  and replayed later, unchanged;
- **unstorable** (the database refused this row's values): the result is recorded again without
  its evidence, which is replaced by a note saying why, so the verdict and incident still land. A
  result that cannot be stored even so is dropped and counted: it must not block the spool.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    InternalError,
    OperationalError,
    ProgrammingError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.incidents import RecordOutcome, note_config_change, record_result
from kvcanary.monitor.recording.health import WriteHealth
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.spool import Spool
from kvcanary.monitor.storage.db import utcnow
from kvcanary.monitor.storage.incident_rows import open_incident_keys
from kvcanary.monitor.storage.probe_states import load_state, load_states, save_state
from kvcanary.monitor.storage.result_rows import insert_rows, probe_result_values
from kvcanary.monitor.storage.retention import without_excerpts
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.probes.base import ProbeResult, Verdict

log = logging.getLogger("kvcanary.recorder")

#: What stands in for excerpts the settings keep out of the database.
EXCERPTS_OFF = "not stored (evidence.excerpts: false)"

# Errors that say nothing about the row: the database is not there (or not ready) right now.
# ProgrammingError is among them: a database restored without its schema refuses every row alike;
# so is InternalError: a primary demoted in a failover answers every write with "read-only
# transaction" (SQLSTATE 25006). Spooled, a verdict waits; taken for a refusal of its row, it was
# dropped.
_UNAVAILABLE = (
    OperationalError, InterfaceError, DisconnectionError, PoolTimeout, ProgrammingError, InternalError
)  # fmt: skip


class Recorder:
    """Writes results through ``session_factory``; spools them while the database is away."""

    def __init__(
        self,
        settings: Settings,
        session_factory: sessionmaker[Session],
        spool: Spool,
        health: WriteHealth | None = None,
    ):
        self.settings = settings
        self.session_factory = session_factory
        self.spool = spool
        self.unstorable = 0
        #: Whether results are landing (``/healthz``, ``kvcanary_database_up``).
        self.health = health or WriteHealth()
        self._replaying = threading.Lock()
        # Target rows by (name, engine, base_url, model): the upsert's SELECT is not paid on every run.
        self._target_ids: dict[tuple[str, str, str, str], int] = {}

    def record(self, item: PendingResult) -> RecordOutcome | None:
        """Record one result; return what it did to incidents, or None when it was spooled (or dropped)."""
        if len(self.spool) or self.health.lost:
            # Older results wait: this one queues behind them, so each pair stays in order.
            self.spool.append(item)
            self.replay()
            return None
        try:
            outcome = self._write(item)
        except _UNAVAILABLE as exc:
            self._spool(item, exc)
            return None
        self.health.succeeded()
        return outcome

    def record_many(self, items: list[PendingResult]) -> list[RecordOutcome | None]:
        """Record ``items`` in order in one transaction (one commit for many results).

        Behind a non-empty spool they queue there; when the database is away they are spooled; when
        one of them is refused, each is recorded on its own (:meth:`record`'s rules).
        """
        if len(self.spool) or self.health.lost:
            for item in items:
                self.spool.append(item)
            self.replay()
            return [None] * len(items)
        try:
            with self.session_factory() as session, session.begin():
                outcomes = self._insert_batch(session, items)
        except _UNAVAILABLE as exc:
            for item in items:
                self._spool(item, exc)
            return [None] * len(items)
        except Exception:  # one row refused: each on its own (a stale cached target id is retried there)
            return [self.record(item) for item in items]
        self.health.succeeded()
        for item, outcome in zip(items, outcomes, strict=True):
            self._target_ids[item.target_key] = outcome.target_id
        return list(outcomes)

    def _insert_batch(self, session: Session, items: list[PendingResult]) -> list[RecordOutcome]:
        """Record ``items`` in ``session``'s transaction, reading the open incidents once for all.

        Most results are passes of pairs with nothing open: they change no incident, so they are
        inserted together in one statement, after one query for the batch's open incidents. Any
        other result goes through the incident rules, and a pair whose earlier result in the batch
        was not such a pass takes the rules from then on.
        """
        known = {id(item): self._known(item) for item in items}
        open_now = open_incident_keys(session, (t for t in known.values() if t is not None))
        outcomes: list[RecordOutcome | None] = []
        quiet: list[tuple[int, int, dict[str, Any]]] = []  # (index, target id, row values)
        for index, item in enumerate(items):
            target_id = known[id(item)]
            pair = (target_id, item.kind, item.node)
            changed = bool(item.result.measurements.get("config_changed"))
            passed = item.result.verdict is Verdict.PASS
            if passed and target_id is not None and pair not in open_now and not changed:
                quiet.append((index, target_id, self._quiet_row(session, item, target_id)))
                outcomes.append(None)
                continue
            # The rules read earlier results (an error streak): the rows before this one go in first.
            self._insert_quiet(session, quiet, outcomes)
            outcome = self._insert_in(session, item, self._prepared(item), target_id)
            open_now.add((outcome.target_id, item.kind, item.node))
            outcomes.append(outcome)
        self._insert_quiet(session, quiet, outcomes)
        return [o for o in outcomes if o is not None]

    @staticmethod
    def _insert_quiet(
        session: Session, quiet: list[tuple[int, int, dict[str, Any]]], outcomes: list[RecordOutcome | None]
    ) -> None:
        """Insert the waiting quiet passes in one statement and fill in their outcomes."""
        ids = insert_rows(session, [values for _, _, values in quiet])
        for (index, target_id, _), result_id in zip(quiet, ids, strict=True):
            outcomes[index] = RecordOutcome(result_id, None, None, None, target_id=target_id)
        quiet.clear()

    def _quiet_row(self, session: Session, item: PendingResult, target_id: int) -> dict[str, Any]:
        """Return the row of a pass that changes no incident; store the state it carries."""
        result = self._prepared(item)
        values = probe_result_values(
            item.kind, item.node, result, item.started_at, item.duration_seconds, self.settings.retention
        )
        if result.state is not None:
            save_state(
                session, target_id=target_id, probe=item.kind, node=item.node, state=result.state,
                now=item.attempted_at,
            )  # fmt: skip
        return {**values, "target_id": target_id}

    def replay(self) -> int:
        """Record spooled results oldest first until the spool is empty or the database fails again.

        Return how many were recorded. A replay already running in another thread makes this a no-op.
        """
        if self.health.lost or not self._replaying.acquire(blocking=False):
            return 0  # a database file gone: nothing is written into what remains of it
        done = 0
        try:
            while (item := self.spool.head()) is not None:
                try:
                    self._write(item)
                except _UNAVAILABLE as exc:
                    self.health.failed(type(exc).__name__)
                    break
                self.health.succeeded()
                self.spool.remove(item)
                done += 1
        finally:
            self._replaying.release()
        if done:
            log.warning("replayed %d spooled result(s); %d still waiting", done, len(self.spool))
        return done

    def _spool(self, item: PendingResult, exc: Exception) -> None:
        self.health.failed(type(exc).__name__)
        kept = self.spool.append(item)
        log.warning(
            "database unavailable (%s): %s %s/%s %s",
            type(exc).__name__,
            item.result.verdict,
            item.target,
            item.kind,
            f"spooled in {self.spool.where} ({len(self.spool)} waiting)" if kept else "DROPPED: spool full",
        )

    def _write(self, item: PendingResult) -> RecordOutcome | None:
        """Record ``item``; on a refusal of its values, record it without evidence. Raise when unavailable."""
        try:
            return self._insert(item, self._prepared(item))
        except _UNAVAILABLE:
            raise
        except Exception as exc:  # DataError, IntegrityError, an odd value: the row, not the server
            refused = _describe(exc)
        log.error(
            "could not store %s/%s %s (%s); recording it without evidence",
            item.target,
            item.kind,
            item.result.verdict,
            refused,
        )
        detail = item.result.detail.encode("ascii", "replace").decode("ascii")
        bare = replace(item.result, evidence={"evidence_unstorable": refused}, detail=detail)
        try:
            return self._insert(item, bare)
        except _UNAVAILABLE:
            raise
        except Exception as exc:
            self.unstorable += 1
            self.spool.dropped[item.result.verdict.value] += 1
            log.critical(
                "DROPPED %s result of %s/%s: the database refuses it (%s)",
                item.result.verdict,
                item.target,
                item.kind,
                _describe(exc),
            )
            return None

    def load_state(self, target: str, kind: str, node: str) -> dict[str, Any] | None:
        """Return the state a probe stored for (target, node), {} when none; None when the database is
        away (unknown is not empty: a replay baseline or a counter reading may be stored there)."""
        try:
            with self.session_factory() as session:
                return load_state(session, target=target, probe=kind, node=node) or {}
        except _UNAVAILABLE:
            return None

    def ensure_targets(self, targets: Iterable[TargetConfig]) -> None:
        """Give every configured target its row and cache its id, in one transaction at start.

        Without it, the first result of each target took the slow path (an upsert and the incident
        rules, ~2 ms): thousands of targets starting at once kept the core behind for minutes.
        With the database away, first results upsert their target as they come.
        """
        keys = [(t.name, t.engine, t.base_url, t.model) for t in targets]
        try:
            with self.session_factory() as session, session.begin():
                ids = upsert_targets(session, keys, utcnow())
        except _UNAVAILABLE:
            return
        for key in keys:
            self._target_ids[key] = ids[key[0]]

    def load_states(self) -> dict[tuple[str, str, str], dict[str, Any]] | None:
        """Return every stored probe state by (target, kind, node); None when the database is away."""
        try:
            with self.session_factory() as session:
                return load_states(session)
        except _UNAVAILABLE:
            return None

    def _prepared(self, item: PendingResult) -> ProbeResult:
        """Return the result as it is stored: without its excerpts where the settings keep none."""
        if self.settings.evidence.excerpts:
            return item.result
        return replace(item.result, evidence=without_excerpts(item.result.evidence, EXCERPTS_OFF))

    def _known(self, item: PendingResult) -> int | None:
        return self._target_ids.get(item.target_key)

    def _insert(self, item: PendingResult, result: ProbeResult) -> RecordOutcome:
        key = item.target_key
        try:
            outcome = self._insert_once(item, result, self._target_ids.get(key))
        except _UNAVAILABLE:
            raise
        except Exception:
            if self._target_ids.pop(key, None) is None:
                raise
            outcome = self._insert_once(item, result, None)  # the row may be gone: upsert it again
        self._target_ids[key] = outcome.target_id
        return outcome

    def _insert_once(self, item: PendingResult, result: ProbeResult, target_id: int | None) -> RecordOutcome:
        with self.session_factory() as session, session.begin():
            return self._insert_in(session, item, result, target_id)

    def _insert_in(
        self,
        session: Session,
        item: PendingResult,
        result: ProbeResult,
        target_id: int | None,
    ) -> RecordOutcome:
        """Record one result in ``session``'s transaction (the caller commits)."""
        outcome = record_result(
            session,
            target_name=item.target,
            engine=item.engine,
            base_url=item.base_url,
            model=item.model,
            probe=item.kind,
            result=result,
            started_at=item.started_at,
            duration_seconds=item.duration_seconds,
            policy=self.settings.incidents,
            retention=self.settings.retention,
            now=item.attempted_at,
            node=item.node,
            target_id=target_id,
        )
        if result.measurements.get("config_changed"):
            note_config_change(
                session,
                target_id=outcome.target_id,
                result_id=outcome.result_id,
                now=item.attempted_at,
            )
        if result.state is not None:
            save_state(
                session,
                target_id=outcome.target_id,
                probe=item.kind,
                node=item.node,
                state=result.state,
                now=item.attempted_at,
            )
        return outcome


def _describe(exc: BaseException) -> str:
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        return f"{type(exc).__name__}: {type(exc.orig).__name__}"
    return type(exc).__name__
