"""A bounded local spool for probe results the database could not take, replayed in order.

A verdict that is not recorded is the worst failure a monitor of leaks can have. When the database
is down, :class:`Spool` keeps each result as one file in a private folder (``0700``, files
``0600``), named by a sequence number so the folder itself is the queue; the recorder replays them
oldest first once the database answers, and only then records new results directly, so that each
(target, probe) keeps its order.

The spool is bounded (``max_entries``). When it is full, a new result displaces the oldest entry of
a lesser verdict (pass < error < mismatch < leak); with none lesser, the new one is dropped. So
leaks and mismatches are never dropped while passes or errors hold room, and every drop is
counted (:attr:`Spool.dropped`).

Evidence in the spool is what the database would hold: already redacted by the probes.
Without a folder (``path=None``) the spool lives in memory: bounded the same way, lost on exit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
from collections import Counter
from pathlib import Path

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.probes.base import Verdict

log = logging.getLogger("kvcanary.spool")

#: Which entries yield their room to which: a higher rank displaces a lower one when full.
RANK = {Verdict.PASS: 0, Verdict.ERROR: 1, Verdict.MISMATCH: 2, Verdict.LEAK: 3}


class Spool:
    """Pending results, oldest first, in a folder (or in memory). Thread-safe."""

    def __init__(self, path: Path | None, max_entries: int = 10_000):
        self.max_entries = max_entries
        self.dropped: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._entries: dict[int, PendingResult] = {}
        self._next = 1
        self._dir: Path | None = None
        self._dir_lock_fd: int | None = None
        if path is not None:
            self._open_dir(Path(path))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def where(self) -> str:
        return str(self._dir) if self._dir is not None else "memory"

    def append(self, item: PendingResult) -> bool:
        """Queue ``item``; return False when it was dropped because the spool is full of worse news."""
        with self._lock:
            if len(self._entries) >= self.max_entries and not self._make_room(item.result.verdict):
                self.dropped[item.result.verdict.value] += 1
                log.error(
                    "spool full: dropped a %s result of %s/%s", item.result.verdict, item.target, item.kind
                )
                return False
            item.seq = self._next
            self._next += 1
            self._entries[item.seq] = item
            self._write(item)
            return True

    def head(self) -> PendingResult | None:
        """Return the oldest entry without removing it."""
        with self._lock:
            return self._entries[min(self._entries)] if self._entries else None

    def remove(self, item: PendingResult) -> None:
        """Forget ``item`` (it was recorded)."""
        with self._lock:
            if self._entries.pop(item.seq, None) is not None and self._dir is not None:
                with contextlib.suppress(FileNotFoundError):
                    (self._dir / _name(item.seq)).unlink()

    def close(self) -> None:
        if self._dir_lock_fd is not None:
            os.close(self._dir_lock_fd)
            self._dir_lock_fd = None

    # --- internals ---------------------------------------------------------------------------------

    def _make_room(self, verdict: Verdict) -> bool:
        """Drop the oldest entry of the lowest rank below ``verdict``'s; False when there is none."""
        for rank in range(RANK[verdict]):
            victim = next((e for e in self._entries.values() if RANK[e.result.verdict] == rank), None)
            if victim is not None:
                self.dropped[victim.result.verdict.value] += 1
                log.error(
                    "spool full: dropped a queued %s of %s/%s to keep a %s",
                    victim.result.verdict,
                    victim.target,
                    victim.kind,
                    verdict,
                )
                self.remove(victim)
                return True
        return False

    def _open_dir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)
        fd = os.open(path / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise SpoolBusy(f"spool folder {path} is in use by another kvcanary process") from None
        self._dir, self._dir_lock_fd = path, fd
        for file in sorted(path.glob("*.json")):
            item = _load(file)
            if item is None:
                log.error("spool: unreadable entry %s kept aside as %s.bad", file.name, file.name)
                file.rename(file.with_suffix(".json.bad"))
                continue
            self._entries[item.seq] = item
            self._next = max(self._next, item.seq + 1)
        if self._entries:
            log.warning("spool: %d result(s) from an earlier run wait in %s", len(self._entries), path)

    def _write(self, item: PendingResult) -> None:
        if self._dir is None:
            return
        final = self._dir / _name(item.seq)
        tmp = final.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(item.stored(), out, default=str)
                out.flush()
                os.fsync(out.fileno())
            tmp.replace(final)
        except OSError as exc:  # a full disk must not cost the verdict: memory still holds it
            log.error("spool: cannot write %s (%s); the entry is kept in memory only", final, exc.strerror)


class SpoolBusy(Exception):
    """Another process holds the spool folder."""


def _name(seq: int) -> str:
    return f"{seq:016d}.json"


def _load(file: Path) -> PendingResult | None:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        return PendingResult.from_stored(data)
    except (OSError, ValueError, TypeError):
        return None


def state_dir() -> Path:
    """Return where kvcanary keeps local state: $KVCANARY_STATE_DIR, else the XDG state folder."""
    if explicit := os.environ.get("KVCANARY_STATE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "kvcanary"


def open_spool(settings: Settings) -> Spool:
    """Return the spool the settings ask for; in memory when its folder is held by another process."""
    config = settings.spool
    if config.in_memory:
        return Spool(None, config.max_entries)
    # One folder per database: two configs on one machine must not replay into each other's database.
    named = hashlib.sha256(settings.database_url.encode()).hexdigest()[:12]
    path = config.path or state_dir() / f"spool-{named}"
    try:
        return Spool(path, config.max_entries)
    except SpoolBusy as exc:
        log.warning("%s: this process spools in memory", exc)
    except OSError as exc:
        log.warning("cannot use spool folder %s (%s): this process spools in memory", path, exc.strerror)
    return Spool(None, config.max_entries)
