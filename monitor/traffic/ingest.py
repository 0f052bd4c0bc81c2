"""``POST /api/v1/traffic`` behind the router: judge a batch, store what is kept, record verdicts.

The rows and counts of a batch are written in one transaction; a database that fails it fails the
request (503 from ``monitor/api/outage.py``), so the tap keeps the batch and sends it again. The
results go through the recording port like every probe's (``monitor/recording/port.py``), which
spools them while the database is away.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from monitor.recording.port import RecordingPort
from monitor.storage.models import Target
from monitor.storage.traffic_rows import write_traffic
from monitor.traffic.judge import Judged, TrafficJudge
from monitor.traffic.schema import TrafficBatch


class TrafficIngest:
    """Judges, stores and records one batch at a time per deployment (the judge's locks)."""

    def __init__(
        self, judge: TrafficJudge, port: RecordingPort | None, session_factory: sessionmaker[Session]
    ):
        self.judge = judge
        self.port = port
        self.session_factory = session_factory

    async def __call__(self, batch: TrafficBatch) -> dict[str, Any]:
        judged = await self.judge.judge(batch)
        if judged.kept or judged.minutes:
            await asyncio.to_thread(self._write, judged)
        if self.port is not None and judged.results:
            await asyncio.gather(*(self.port.submit(item) for item in judged.results))
        return judged.answer()

    def _write(self, judged: Judged) -> None:
        with self.session_factory.begin() as session:
            ids = {name: id_ for name, id_ in session.execute(select(Target.name, Target.id))}
            write_traffic(session, ids, judged.kept, judged.minutes)  # targets get rows at start and reload
