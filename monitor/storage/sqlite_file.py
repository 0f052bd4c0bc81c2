"""The SQLite file under a running monitor: one process at a time, and noticed when it goes away.

SQLite is one process (PostgreSQL is for replicas): two ``serve`` processes on one file ran every
probe twice and paged twice, silently. :meth:`SqliteFile.lock` takes an exclusive lock on
``<file>.lock`` for the process's life; a second process refuses to start, naming the first's pid.

A file deleted or replaced under a running monitor (a cleanup job, a restore over it) went
unnoticed: writes landed in the deleted inode, ``/healthz`` stayed green, and everything since the
last backup vanished at exit. :meth:`SqliteFile.check` compares the path with the file opened at
start; when it differs, :meth:`save_orphan` copies what the monitor still holds (through a
connection kept open on the original file for this purpose) to ``<file>.orphaned-<time>``, and no
new connection is made to a path that is not the original file (``do_connect`` refuses), so
results go to the spool instead of into a file nobody will read.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, make_url

log = logging.getLogger("kvcanary.storage")


class DatabaseInUse(Exception):
    """Another process holds the SQLite file."""


class SqliteFile:
    """The database file of ``path``, as opened at start."""

    def __init__(self, path: Path):
        self.path = path
        self._lock_fd: int | None = None
        stat = path.stat()
        self._identity = (stat.st_dev, stat.st_ino)
        # Keeps the original inode readable whatever happens to the path (see save_orphan).
        self._anchor = sqlite3.connect(str(path), check_same_thread=False)
        # Read once now: a connection that first reads after the file is unlinked cannot map its WAL.
        self._anchor.execute("SELECT count(*) FROM sqlite_master").fetchone()

    def lock(self) -> None:
        """Hold ``<file>.lock`` for this process's life; raise DatabaseInUse when another holds it."""
        lock = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DatabaseInUse(
                f"{self.path} is in use by another kvcanary process (pid {holder}): SQLite serves one "
                "process; run replicas on PostgreSQL"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def check(self) -> str:
        """Return "" while the path is the file opened at start, else what happened to it."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return f"the SQLite file {self.path} was deleted"
        if (stat.st_dev, stat.st_ino) != self._identity:
            return f"the SQLite file {self.path} was replaced by another file"
        return ""

    def save_orphan(self) -> Path | None:
        """Copy the original file's content (from the connection kept on it) beside the path."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        target = self.path.with_name(f"{self.path.name}.orphaned-{stamp}")
        try:
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # evidence: 0600
            with contextlib.closing(sqlite3.connect(str(target))) as copy:
                self._anchor.backup(copy)
                # One self-contained file, no WAL of its own to lose when it is moved back in place.
                copy.execute("PRAGMA journal_mode=DELETE").fetchall()
            with contextlib.suppress(FileNotFoundError):  # the copy's own (empty) WAL: not needed
                target.with_name(target.name + "-wal").unlink()
            self._empty_wal()
        except (sqlite3.Error, OSError) as exc:
            log.error("could not save the orphaned database to %s: %s", target, exc)
            return None
        return target

    def take_over_if_lost(self, health: Any, engine: Engine) -> None:  # health: recording.health.WriteHealth
        """Notice the file deleted or replaced under the process: from then on results are spooled
        (``health.lost`` is set before the copy, so none lands after its snapshot), what the file
        held is saved beside the path, and pooled connections into the gone file are dropped (new
        ones meet the guard). Once only: a lost file stays lost until the restart."""
        if health.lost or not (lost := self.check()):
            return
        health.lost = lost
        saved = self.save_orphan()
        kept = f"what it held is saved as {saved}" if saved else "what it held could not be saved"
        health.lost = f"{lost}; {kept}"
        engine.dispose()
        log.critical(
            "%s; %s. Results are spooled from now on: put a migrated database at %s (the saved copy "
            "is one) and restart kvcanary",
            lost,
            kept,
            self.path,
        )

    def guard(self, engine: Engine) -> None:
        """Refuse new connections of ``engine`` while the path is not the original file: SQLite
        would create an empty file there, and results would land in it unseen."""

        def refuse_if_lost(dialect: Any, conn_rec: Any, cargs: Any, cparams: Any) -> None:
            if lost := self.check():
                raise sqlite3.OperationalError(f"{lost}; not opening it")

        event.listen(engine, "do_connect", refuse_if_lost)

    def _empty_wal(self) -> None:
        """Fold the WAL into the deleted file and truncate it: a WAL left at the path would be
        replayed over whatever database is put back there."""
        busy, _, _ = self._anchor.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            log.warning("the WAL of %s is held by a reader: it is removed at exit", self.path)

    def close(self) -> None:
        gone = self.check()
        if gone:  # the last connection on a file that is gone: leave no WAL behind
            with contextlib.suppress(sqlite3.Error):
                self._empty_wal()
        self._anchor.close()
        if gone and not self.path.exists():
            # Its WAL and shared-memory files would be taken for those of the next file put here.
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    self.path.with_name(self.path.name + suffix).unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def sqlite_file_of(url: str) -> SqliteFile | None:
    """Return the SQLite file of ``url`` (None for PostgreSQL and in-memory databases)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return SqliteFile(Path(parsed.database))
