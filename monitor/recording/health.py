"""Whether results are being written: the outcome and age of the last write, as ``/healthz`` and
``kvcanary_database_up`` report them.

A ``SELECT 1`` said healthy while every write failed (a full disk, a primary demoted to read-only):
for 100 s ``/healthz`` stayed 200 and ``kvcanary_database_up`` 1, so ``KVCanaryDatabaseDown`` could
not fire. What matters is whether verdicts land; the recorder notes each write's outcome here.
"""

from __future__ import annotations

import time
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

    def succeeded(self) -> None:
        self.last_success_at, self.last_failed = time.time(), False

    def failed(self, error: str) -> None:
        self.last_failure_at, self.last_error, self.last_failed = time.time(), error, True

    @property
    def failing(self) -> bool:
        """True while the last write attempt failed, or the database file is lost."""
        return bool(self.lost) or self.last_failed

    def report(self) -> dict[str, object]:
        now = time.time()
        report: dict[str, object] = {"status": "failing" if self.failing else "ok"}
        if self.last_success_at:
            report["last_success_age_seconds"] = round(now - self.last_success_at, 1)
        if self.failing:
            report["last_error"] = self.lost or self.last_error
        return report
