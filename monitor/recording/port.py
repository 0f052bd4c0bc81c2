"""The one recording port: how any verdict (a probe run's, a traffic check's) becomes a row, an
incident change and a page.

Both sources hand a :class:`~monitor.recording.pending.PendingResult` to :meth:`RecordingPort.submit`:
the batching writer records it (``writer.py``: group commit, the spool while the database is
away), and when the recording changed an incident the pager is nudged at once instead of at its
next poll; a suspected failure that landed on an incident is handed on to be verified; and every
verdict, once recorded, is offered to ``on_recorded`` (its OpenTelemetry event, ``monitor/otel.py``),
which must not wait. The runner adds what is its own around the call (the per-pair lock, replica
ownership, its metrics); the traffic judge adds its own (the deployment's lock and counters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcanary.monitor.incidents import RecordOutcome
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.recording.result_writer import ResultWriter


class RecordingPort:
    """A ``ResultWriter`` that records through ``writer`` and calls ``on_change`` (the pager's
    nudge) after a change, ``on_suspicion`` with a suspected failure and its incident's id once
    recorded, and ``on_recorded`` with every result and its outcome (None: spooled, or queued
    unawaited)."""

    def __init__(
        self,
        writer: ResultWriter,
        on_change: Callable[[], None] | None = None,
        on_suspicion: Callable[[PendingResult, int], object] | None = None,
        on_recorded: Callable[[PendingResult, RecordOutcome | None], None] | None = None,
    ):
        self.writer = writer
        self.on_change = on_change
        self.on_suspicion = on_suspicion
        self.on_recorded = on_recorded

    async def submit(self, item: PendingResult) -> RecordOutcome | None:
        outcome = await self.writer.submit(item)
        if outcome is not None and outcome.change is not None and self.on_change is not None:
            self.on_change()
        if outcome is not None and outcome.incident_id is not None and item.suspected and self.on_suspicion:
            self.on_suspicion(item, outcome.incident_id)
        if self.on_recorded is not None:
            self.on_recorded(item, outcome)
        return outcome

    def enqueue(self, item: PendingResult) -> None:
        """Queue without waiting (a cancelled run's finding); the writer records it before it stops."""
        self.writer.enqueue(item)
        if self.on_recorded is not None:
            self.on_recorded(item, None)

    def load_state(self, target: str, kind: str, node: str) -> dict[str, Any] | None:
        return self.writer.load_state(target, kind, node)
