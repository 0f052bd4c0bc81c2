"""``POST /api/v1/traffic`` behind the router: judge a batch, store what is kept, record verdicts.

The rows and counts of a batch are written in one transaction; a database that fails it fails the
request (503 from ``monitor/api/outage.py``), so the tap keeps the batch and sends it again. A
batch the tap sends again because its answer was lost (the same ``batch`` id) is answered from
memory, not judged twice; one being judged now is waited for. The results go through the recording
port like every probe's (``monitor/recording/port.py``), which spools them while the database is
away. A gateway's report of the records it dropped is counted once its batch is stored.
"""

from __future__ import annotations

import asyncio
import collections
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from monitor.recording.port import RecordingPort
from monitor.storage.target_rows import upsert_targets
from monitor.storage.traffic_rows import write_traffic
from monitor.traffic.judge import Judged, TrafficJudge
from monitor.traffic.schema import TrafficBatch, TrafficRecord

#: Batch ids remembered (a tap sends a batch again only until it is taken: a few suffice).
REMEMBERED_BATCHES = 4096
#: Gateways named in metric labels; any more are counted as "other" (a label per client is unbounded).
MAX_GATEWAYS = 64


class TrafficIngest:
    """Judges, stores and records one batch at a time per deployment (the judge's locks)."""

    def __init__(
        self, judge: TrafficJudge, port: RecordingPort | None, session_factory: sessionmaker[Session]
    ):
        self.judge = judge
        self.port = port
        self.session_factory = session_factory
        self._answers: collections.OrderedDict[str, asyncio.Future[dict[str, Any]]] = (
            collections.OrderedDict()
        )
        self._target_ids: dict[str, int] = {}
        self._gateways: set[str] = set()

    async def __call__(self, batch: TrafficBatch, records: list[TrafficRecord]) -> dict[str, Any]:
        if batch.batch is None:
            return await self._ingest(batch, records)
        known = self._answers.get(batch.batch)
        if known is not None:
            return await asyncio.shield(known)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[batch.batch] = future
        try:
            answer = await self._ingest(batch, records)
        except BaseException as exc:
            del self._answers[batch.batch]  # not taken: judged again when it comes again
            future.set_exception(exc)
            future.exception()  # retrieved: a waiter may not exist
            raise
        future.set_result(answer)
        while len(self._answers) > REMEMBERED_BATCHES:
            self._answers.popitem(last=False)
        return answer

    async def _ingest(self, batch: TrafficBatch, records: list[TrafficRecord]) -> dict[str, Any]:
        gateway = self._gateway(batch.gateway)
        judged = await self.judge.judge(records, gateway)
        if judged.kept or judged.minutes:
            await asyncio.to_thread(self._write, judged)
        if batch.dropped:
            self.judge.metrics.traffic_dropped.labels(gateway).inc(batch.dropped)
        if self.port is not None and judged.results:
            await asyncio.gather(*(self.port.submit(item) for item in judged.results))
        return judged.answer()

    def _gateway(self, name: str) -> str:
        name = name or "unnamed"
        if name not in self._gateways and len(self._gateways) < MAX_GATEWAYS:
            self._gateways.add(name)
        return name if name in self._gateways else "other"

    def _write(self, judged: Judged) -> None:
        with self.session_factory.begin() as session:
            missing = {name for name, _ in judged.kept} | {key[0] for key in judged.minutes}
            missing -= self._target_ids.keys()
            if missing:  # a target's row, made at start or reload unless the database was away then
                targets = [t for t in self.judge.settings.targets if t.name in missing]
                rows = [(t.name, t.engine, t.base_url, t.model) for t in targets]
                self._target_ids.update(upsert_targets(session, rows, datetime.now(UTC)))
            write_traffic(session, self._target_ids, judged.kept, judged.minutes)
