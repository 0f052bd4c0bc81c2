"""Whether results are being written: the outcome and age of the last write, as ``/healthz`` and
``kvcanary_database_up`` report them.

A ``SELECT 1`` said healthy while every write failed (a full disk, a primary demoted to read-only):
for 100 s ``/healthz`` stayed 200 and ``kvcanary_database_up`` 1, so ``KVCanaryDatabaseDown`` could
not fire. What matters is whether verdicts land; the recorder notes each write's outcome here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class WriteHealth:
    """The last write's outcome, as the recorder saw it (wall-clock times, 0 for never)."""

    last_success_at: float = 0.0
    last_failure_at: float = 0.0
    last_error: str = ""
    #: Set when the database file itself is gone or replaced (SQLite): nothing written lands.
    lost: str = ""
    #: Whether the last write attempt failed (not a comparison of times: a clock may step back).
    last_failed: bool = False
    #: Says now whether the database file is gone (SQLite's ``SqliteFile.check``), so a deletion is
    #: reported by the first health check or scrape after it, not after the watcher's next look.
    file_check: Callable[[], str] | None = None

    def succeeded(self) -> None:
        self.last_success_at, self.last_failed = time.time(), False

    def failed(self, error: str) -> None:
        self.last_failure_at, self.last_error, self.last_failed = time.time(), error, True

    @property
    def gone(self) -> str:
        """Why nothing written lands: the file was taken over as lost, or is found gone now."""
        return self.lost or (self.file_check() if self.file_check else "")

    @property
    def failing(self) -> bool:
        """True while the last write attempt failed, or the database file is lost."""
        return self.last_failed or bool(self.gone)

    def report(self) -> dict[str, object]:
        now, gone = time.time(), self.gone
        report: dict[str, object] = {"status": "failing" if gone or self.last_failed else "ok"}
        if self.last_success_at:
            report["last_success_age_seconds"] = round(now - self.last_success_at, 1)
        if gone or self.last_failed:
            report["last_error"] = gone or self.last_error
        return report
