"""What one source counted: matching responses by caller (the monitor's own apart) and by time.

Every source answers the same grouped rows, ``(caller, own, bucket, responses, first, last)``
with times as epoch seconds, so that each can count in its own engine (SQL or DuckDB) and the
report reads them all alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass
class CallerCount:
    responses: int = 0
    first: float = float("inf")
    last: float = float("-inf")

    def add(self, n: int, first: float, last: float) -> None:
        self.responses += n
        self.first = min(self.first, first)
        self.last = max(self.last, last)

    def as_json(self, caller: str) -> dict[str, Any]:
        return {
            "caller": caller,
            "responses": self.responses,
            "first": _iso(self.first),
            "last": _iso(self.last),
        }


@dataclass
class Tally:
    """One source's answer. ``covered`` is False where the source holds nothing of the target in
    the window (then its zero is no answer); ``note`` says what limits it."""

    name: str  # "recorded traffic", "gateway logs", "LiteLLM_SpendLogs"
    detail: str  # what was read (a glob, a table), never a credential
    covered: bool = False
    rows_read: int | None = None
    notes: list[str] = field(default_factory=list)
    callers: dict[str, CallerCount] = field(default_factory=dict)
    own: dict[str, CallerCount] = field(default_factory=dict)
    #: Matching responses per time bucket (customers' only; exclusions are taken out by the report).
    buckets: dict[str, Counter[int]] = field(default_factory=dict)

    def add_groups(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Add grouped rows ``(caller, own, bucket, responses, first, last)``."""
        for caller, own, bucket, n, first, last in rows:
            caller = caller or ""
            book = self.own if own else self.callers
            book.setdefault(caller, CallerCount()).add(int(n), float(first), float(last))
            if not own:
                self.buckets.setdefault(caller, Counter())[int(bucket)] += int(n)

    @property
    def responses(self) -> int:
        return sum(c.responses for c in self.callers.values())


def _iso(epoch: float) -> str | None:
    if epoch in (float("inf"), float("-inf")):
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")
