"""The storage's jobs on the clock: prune what expired, offer spooled results again, and notice a
SQLite file deleted or replaced under the process."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.storage.retention import prune_round
from kvcanary.monitor.storage.sqlite_file import SqliteFile

log = logging.getLogger("kvcanary")

PRUNE_INTERVAL_SECONDS = 3600
#: How often spooled results are offered to the database again.
REPLAY_INTERVAL_SECONDS = 5
#: How often a SQLite file is checked for having been deleted or replaced under the process.
FILE_CHECK_SECONDS = 2


class StorageUpkeep:
    """What keeps the results' storage bounded and whole between probe runs; :meth:`jobs` for the clock.

    ``settings`` returns the settings in force (a reload replaces them); ``sqlite`` is the database
    file where the database is SQLite, else None.
    """

    def __init__(
        self,
        settings: Callable[[], Settings],
        session_factory: sessionmaker[Session],
        recorder: Recorder,
        engine: Engine,
        sqlite: SqliteFile | None,
    ):
        self._settings = settings
        self._session_factory = session_factory
        self._recorder = recorder
        self._engine = engine
        self._sqlite = sqlite

    def jobs(self) -> list[tuple[str, Callable[[], Awaitable[None]], float]]:
        """(name, what it runs, every how many seconds) for each job, as the scheduler takes them."""
        jobs: list[tuple[str, Callable[[], Awaitable[None]], float]] = [
            ("prune", self.prune, PRUNE_INTERVAL_SECONDS),
            ("replay", self.replay, REPLAY_INTERVAL_SECONDS),
        ]
        if self._sqlite is not None:
            jobs.append(("database-file", self.watch_database_file, FILE_CHECK_SECONDS))
        return jobs

    async def prune(self) -> None:
        """Delete expired results and purge expired excerpts, a batch per transaction. While the
        database is away this round is skipped with one line (the next, an interval on, tries
        again): a traceback per round would only bury the outage's own log lines."""
        settings = self._settings()
        # Judged ids are needed while a record can still come again: twice the duplicate window.
        keep = 2 * settings.traffic.jetstream.duplicate_window_seconds
        days = settings.retention.failure_days
        try:
            removed, purged = await asyncio.to_thread(
                prune_round, self._session_factory, minute_days=days, judged_keep_seconds=keep
            )
        except SQLAlchemyError as exc:
            log.warning("pruning skipped: the database did not answer (%s)", type(exc).__name__)
            return
        if removed or purged:
            log.info("pruned %d expired probe results; purged the excerpts of %d", removed, purged)

    async def replay(self) -> None:
        """Offer the spooled results to the database again (none spooled: nothing to do)."""
        if len(self._recorder.spool):
            await asyncio.to_thread(self._recorder.replay)

    async def watch_database_file(self) -> None:
        """Notice a SQLite file deleted or replaced under the process: save what it held, spool the rest."""
        if self._sqlite is not None:
            await asyncio.to_thread(self._sqlite.take_over_if_lost, self._recorder.health, self._engine)
