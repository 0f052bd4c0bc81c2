"""``POST /api/v1/traffic`` behind the router: judge a batch, store what is kept, record verdicts.

The rows and counts of a batch are written in one transaction; a database that fails it fails the
request (503 from ``monitor/api/outage.py``), so the tap keeps the batch and sends it again. A
batch the tap sends again because its answer was lost (the same ``batch`` id) is answered from
memory, not judged twice; one being judged now is waited for. The results go through the recording
port like every probe's (``monitor/recording/port.py``), which spools them while the database is
away. A gateway's report of the records it dropped is counted once its batch is stored.

With replicas, each deployment's traffic belongs to one of them (rendezvous hashing of (target,
"traffic") over the live replicas, as probe pairs are divided): the replica a batch reaches judges
its own deployments' records and hands the rest to their owners' APIs (``X-KVCanary-Forwarded``),
so each record is judged once and each fingerprint window lives in one place. Each owner's share
of a batch is known by one id wherever the batch arrives (the batch's id and the owner's), so a
batch the tap sends again through a load balancer to another replica is judged once there too.
Owners are handed their shares at once, each within ``FORWARD_TIMEOUT_SECONDS`` (under the tap's
own 5 s); one that does not answer has its records judged where they arrived: a window split for
a while, nothing lost.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from monitor.recording.port import RecordingPort
from monitor.runs.replicas import Membership
from monitor.storage.judged_rows import mark_judged
from monitor.storage.target_rows import upsert_targets
from monitor.storage.traffic_rows import write_traffic
from monitor.traffic.judge import Judged, TrafficJudge
from monitor.traffic.schema import TrafficBatch, TrafficRecord

log = logging.getLogger("kvcanary.traffic")

#: Seconds an owner replica has to take handed-over records before they are judged here.
FORWARD_TIMEOUT_SECONDS = 2.0
#: Batch ids remembered (a tap sends a batch again only until it is taken: a few suffice).
REMEMBERED_BATCHES = 4096
#: Gateways named in metric labels; any more are counted as "other" (a label per client is unbounded).
MAX_GATEWAYS = 64


def share_of(batch: TrafficBatch, owner: str) -> TrafficBatch:
    """The envelope of ``owner``'s share of ``batch``: its id derived from the batch's and the
    owner's, the same on every replica, so a share is judged once wherever the batch is sent."""
    share = None if batch.batch is None else hashlib.sha256(f"{batch.batch}{owner}".encode()).hexdigest()[:32]
    return TrafficBatch.model_construct(batch=share, gateway=batch.gateway, dropped=batch.dropped, records=[])


class TrafficIngest:
    """Judges, stores and records one batch at a time per deployment (the judge's locks)."""

    def __init__(
        self,
        judge: TrafficJudge,
        port: RecordingPort | None,
        session_factory: sessionmaker[Session],
        membership: Membership | None = None,
        token: str | None = None,
    ):
        """``membership``: the replicas (None: this one judges everything); ``token``: the API token
        the other replicas take, to hand them their deployments' records."""
        self.judge = judge
        self.port = port
        self.session_factory = session_factory
        self.membership = membership
        self._forward_headers = {"X-KVCanary-Forwarded": membership.id if membership else "yes"}
        if token is not None:
            self._forward_headers["Authorization"] = f"Bearer {token}"
        self._http: httpx.AsyncClient | None = None
        self._answers: collections.OrderedDict[str, asyncio.Future[dict[str, Any]]] = (
            collections.OrderedDict()
        )
        self._target_ids: dict[str, int] = {}
        self._gateways: set[str] = set()

    async def __call__(
        self, batch: TrafficBatch, records: list[TrafficRecord], forwarded: bool = False
    ) -> dict[str, Any]:
        if not forwarded:
            return await self._dedupe(batch, records, self._route)
        return await self._dedupe(batch, records, self._ingest)

    async def _route(self, batch: TrafficBatch, records: list[TrafficRecord]) -> dict[str, Any]:
        """Judge this replica's deployments' records; hand each other owner its own."""
        membership = self.membership
        if membership is None or len(membership.live) <= 1:
            return await self._ingest(batch, records)
        theirs: dict[str, list[TrafficRecord]] = defaultdict(list)
        mine = []
        for record in records:
            target = self.judge.target_of(record)
            owner = membership.owner(target, "traffic") if target is not None else membership.id
            (mine.append(record) if owner == membership.id else theirs[owner].append(record))
        answers = list(
            await asyncio.gather(
                *(self._forward(owner, batch, handed, mine) for owner, handed in theirs.items())
            )
        )
        answers.append(await self._dedupe(share_of(batch, membership.id), mine, self._ingest))
        return {k: sum(a.get(k, 0) for a in answers) for k in answers[-1]}

    async def _forward(
        self, owner: str, batch: TrafficBatch, records: list[TrafficRecord], fallback: list[TrafficRecord]
    ) -> dict[str, Any]:
        """Post ``records`` to ``owner``; on failure, add them to ``fallback`` (judged here)."""
        url = self.membership.urls.get(owner, "") if self.membership else ""
        body = {
            "batch": share_of(batch, owner).batch,
            "gateway": batch.gateway,
            "records": [r.model_dump(mode="json") for r in records],
        }
        if url:
            try:
                self._http = self._http or httpx.AsyncClient(timeout=FORWARD_TIMEOUT_SECONDS)
                answer = await self._http.post(
                    f"{url}/api/v1/traffic", json=body, headers=self._forward_headers
                )
                if answer.status_code in (200, 422):
                    return dict(answer.json())
                log.warning(
                    "replica %s answered %s to handed-over traffic; judging it here",
                    owner,
                    answer.status_code,
                )
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("replica %s did not take handed-over traffic (%s); judging it here", owner, exc)
        fallback.extend(records)
        return {}

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def _dedupe(
        self,
        batch: TrafficBatch,
        records: list[TrafficRecord],
        ingest: Callable[[TrafficBatch, list[TrafficRecord]], Awaitable[dict[str, Any]]],
    ) -> dict[str, Any]:
        if batch.batch is None:
            return await ingest(batch, records)
        known = self._answers.get(batch.batch)
        if known is not None:
            return await asyncio.shield(known)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[batch.batch] = future
        try:
            answer = await ingest(batch, records)
        except BaseException as exc:
            del self._answers[batch.batch]  # not taken: judged again when it comes again
            future.set_exception(exc)
            future.exception()  # retrieved: a waiter may not exist
            raise
        future.set_result(answer)
        while len(self._answers) > REMEMBERED_BATCHES:
            self._answers.popitem(last=False)
        return answer

    async def _ingest(
        self, batch: TrafficBatch, records: list[TrafficRecord], marks: Sequence[tuple[int, str]] = ()
    ) -> dict[str, Any]:
        gateway = self._gateway(batch.gateway)
        judged = await self.judge.judge(records, gateway)
        if judged.kept or judged.minutes or marks:
            await asyncio.to_thread(self._write, judged, marks)
        if batch.dropped:
            self.judge.metrics.traffic_dropped.labels(gateway).inc(batch.dropped)
        if self.port is not None and judged.results:
            await asyncio.gather(*(self.port.submit(item) for item in judged.results))
        return judged.answer()

    async def ingest_marked(
        self, gateway: str, records: list[TrafficRecord], marks: Sequence[tuple[int, str]], dropped: int = 0
    ) -> dict[str, Any]:
        """Judge records read from the JetStream stream here, whoever owns their deployment (the
        stream's partitions decided that), and store them with their ``(partition, record id)``
        marks in one transaction; return once the rows are stored and the results recorded."""
        envelope = TrafficBatch.model_construct(batch=None, gateway=gateway, dropped=dropped, records=[])
        return await self._ingest(envelope, records, marks)

    def _gateway(self, name: str) -> str:
        name = name or "unnamed"
        if name not in self._gateways and len(self._gateways) < MAX_GATEWAYS:
            self._gateways.add(name)
        return name if name in self._gateways else "other"

    def _write(self, judged: Judged, marks: Sequence[tuple[int, str]] = ()) -> None:
        with self.session_factory.begin() as session:
            mark_judged(session, marks, datetime.now(UTC))
            missing = {name for name, _ in judged.kept} | {key[0] for key in judged.minutes}
            missing -= self._target_ids.keys()
            if missing:  # a target's row, made at start or reload unless the database was away then
                targets = [t for t in self.judge.settings.targets if t.name in missing]
                rows = [(t.name, t.engine, t.base_url, t.model) for t in targets]
                self._target_ids.update(upsert_targets(session, rows, datetime.now(UTC)))
            write_traffic(session, self._target_ids, judged.kept, judged.minutes)
