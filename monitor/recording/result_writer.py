"""The one way a verdict is handed over to be recorded, as the runner and the traffic pipeline see it.

:class:`ResultWriter` is what they call; the batching writer (``writer.py``: group commit, the
spool while the database is away) and the recording port around it (``port.py``: a page and a
verification at once on a change) implement it, and :class:`NotRecorded` is a dry run's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvcanary.monitor.incidents import RecordOutcome
    from kvcanary.monitor.recording.pending import PendingResult


class ResultWriter(Protocol):
    """Records verdicts, and reads back what probes stored with theirs."""

    async def submit(self, item: PendingResult) -> RecordOutcome | None:
        """Record ``item``; return what it did to incidents, None when it was spooled, dropped or
        not recorded."""
        ...

    def enqueue(self, item: PendingResult) -> None:
        """Queue ``item`` without waiting for it (a run being cancelled cannot await its record)."""
        ...

    def load_state(self, target: str, kind: str, node: str) -> dict[str, Any] | None:
        """Return the state a probe stored for (target, kind, node), {} when none; None while the
        database cannot say. Blocks: call it from a thread."""
        ...


class NotRecorded:
    """A dry run's writer: nothing is recorded, and every run starts from an empty state."""

    async def submit(self, item: PendingResult) -> RecordOutcome | None:
        return None

    def enqueue(self, item: PendingResult) -> None:
        return None

    def load_state(self, target: str, kind: str, node: str) -> dict[str, Any] | None:
        return {}
