"""The one way a gateway's records are judged, whichever way they came: ``POST /api/v1/traffic``
taken directly (``ingest.py``, one replica) or the JetStream consumer's pulled messages
(``jetstream.py``). Both hand :meth:`TrafficPipeline.take` a gateway's records, which:

1. drops the records judged already: a record is judged once by ``(partition, record id)``, the
   partition ``kvcanary.wire.partition_of`` of its ``api_base`` (the stream's own key, whichever
   way the record came), looked up in ``traffic_judged`` in one statement for the batch; and waits
   for the ids being taken right now in this process (a tap's resend racing its first send), then
   drops those it finds judged;
2. judges the rest (``TrafficJudge.judge``, under each deployment's lock);
3. stores their rows, counts and marks in one transaction, so a record is judged and marked or
   neither (``storage/judged_rows.py``): a database that fails it fails the take, and the records
   come again (the tap keeps them, the stream delivers them again);
4. hands the results to the recording port (``monitor/recording/port.py``), which spools them
   while the database is away;
5. counts the gateway's report of the records it dropped, carried by the first record of a batch
   or message: a report whose record was judged already was counted with it.

A record whose id is empty (an HTTP tap that sent none) has no identity: it is judged every time it
comes, and marked never. Several replicas keep exactly once only through the stream, whose
partitions give each deployment one replica at a time (``partitions.py``); a mark two replicas
write at once fails the later transaction (the primary key), so even then a record is stored once.

Bodies and messages are read (decoded, validated, refusals named: ``schema.py``) off the event loop,
in at most ``READERS`` threads at once (:func:`read_off_loop`): a hostile or merely large body costs
a reader thread for a while, never the loop that answers ``/healthz`` and runs the canary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.recording.result_writer import ResultWriter
from kvcanary.monitor.storage.judged_rows import Mark, judged_already, mark_judged
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.monitor.storage.traffic_rows import write_traffic
from kvcanary.monitor.traffic.judge import Judged, TrafficJudge
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.wire import PARTITIONS, partition_of

#: Bodies read at once, each in its own thread (the rest wait): reading is CPU, and the GIL is one.
READERS = 2
#: Gateways named in metric labels; any more are counted as "other" (a label per client is unbounded).
MAX_GATEWAYS = 64
#: ``api_base`` values whose partition is remembered (a fleet has a few dozen; a hostile gateway
#: sending more only makes the memory start again).
REMEMBERED_API_BASES = 4096

_In = TypeVar("_In")
_Out = TypeVar("_Out")
_readers = ThreadPoolExecutor(READERS, thread_name_prefix="kvcanary-traffic-read")


async def read_off_loop(read: Callable[[_In], _Out], data: _In) -> _Out:
    """Return ``read(data)`` (``read_batch`` of a body, ``decode_all`` of pulled messages, posted
    records written as the stream's messages), run in one of the ``READERS`` threads (the module
    doc); raise as it does (pydantic's ValidationError for a bad envelope)."""
    return await asyncio.get_running_loop().run_in_executor(_readers, read, data)


@dataclass(slots=True)
class Arrival:
    """A record as it reaches the pipeline: the id it is judged once by (``key``: its ``id``; a
    stream message's record without one, its place in the stream), and the gateway's drop report
    that rode with it (on a batch's or message's first record only)."""

    record: TrafficRecord
    key: str
    dropped: int = 0


def arrivals(records: Sequence[TrafficRecord], dropped: int = 0) -> list[Arrival]:
    """Return a posted batch's records as arrivals: each keyed by its id, the batch's drop report
    riding with the first."""
    return [Arrival(record, record.id, dropped if i == 0 else 0) for i, record in enumerate(records)]


class TrafficPipeline:
    """Takes a gateway's records: judged once, stored, recorded, counted (the module doc)."""

    def __init__(
        self,
        judge: TrafficJudge,
        port: ResultWriter | None,
        session_factory: sessionmaker[Session],
        partitions: int = PARTITIONS,
    ):
        """``partitions``: the stream's partition count (``traffic.jetstream.partitions``), the key
        of every mark, whether the stream is used or not."""
        self.judge = judge
        self.port = port
        self.session_factory = session_factory
        self.partitions = partitions
        #: The marks being taken now in this process: each resolved once its take ends.
        self._taking: dict[Mark, asyncio.Future[None]] = {}
        self._target_ids: dict[str, int] = {}
        self._gateways: set[str] = set()
        #: Each ``api_base`` seen lately and its partition: a record's, without hashing it again.
        self._partitions: dict[str, int] = {}

    async def take(self, gateway: str, arrived: Sequence[Arrival]) -> dict[str, int]:
        """Judge, store and record those of ``arrived`` not judged already; return the answer's
        counts (the judge's, and ``duplicates``: records not judged again). Raise where the
        database fails: nothing of the records is then stored, and they may come again."""
        keyed, unkeyed = self._keyed(arrived)
        await self._wait_for_others(keyed)
        for mark in keyed:  # no await since the wait: no other take claimed one meanwhile
            self._taking[mark] = asyncio.get_running_loop().create_future()
        try:
            seen = await asyncio.to_thread(self._judged_already, list(keyed)) if keyed else set()
            fresh = {mark: a for mark, a in keyed.items() if mark not in seen}
            answer = await self._judge_and_store(gateway, [*fresh.values(), *unkeyed], list(fresh))
        finally:
            for mark in keyed:
                self._taking.pop(mark).set_result(None)
        answer["duplicates"] = len(arrived) - len(fresh) - len(unkeyed)
        return answer

    def _keyed(self, arrived: Sequence[Arrival]) -> tuple[dict[Mark, Arrival], list[Arrival]]:
        """Split ``arrived`` into the keyed records by mark (a record twice in one batch: once) and
        those without an id, which are judged every time."""
        keyed: dict[Mark, Arrival] = {}
        unkeyed: list[Arrival] = []
        for a in arrived:
            if a.key:
                keyed.setdefault((self._partition(a.record.api_base), a.key), a)
            else:
                unkeyed.append(a)
        return keyed, unkeyed

    def _partition(self, api_base: str) -> int:
        found = self._partitions.get(api_base)
        if found is None:
            if len(self._partitions) >= REMEMBERED_API_BASES:
                self._partitions.clear()
            found = self._partitions[api_base] = partition_of(api_base, self.partitions)
        return found

    async def _wait_for_others(self, keyed: dict[Mark, Arrival]) -> None:
        """Return once no other take in this process holds any of ``keyed``'s marks: theirs are
        then stored (found judged) or failed (to be judged here)."""
        while busy := [self._taking[mark] for mark in keyed if mark in self._taking]:
            await asyncio.wait(busy)

    async def _judge_and_store(self, gateway: str, fresh: list[Arrival], marks: list[Mark]) -> dict[str, int]:
        label = self._gateway(gateway)
        judged = await self.judge.judge([a.record for a in fresh], label)
        if judged.kept or judged.minutes or marks:
            await asyncio.to_thread(self._write, judged, marks)
        if dropped := sum(a.dropped for a in fresh):
            self.judge.metrics.traffic_dropped.labels(label).inc(dropped)
        if self.port is not None and judged.results:
            await asyncio.gather(*(self.port.submit(item) for item in judged.results))
        return judged.answer()

    def _gateway(self, name: str) -> str:
        name = name or "unnamed"
        if name not in self._gateways and len(self._gateways) < MAX_GATEWAYS:
            self._gateways.add(name)
        return name if name in self._gateways else "other"

    def _judged_already(self, marks: list[Mark]) -> set[Mark]:
        with self.session_factory() as session:
            return judged_already(session, marks)

    def _write(self, judged: Judged, marks: Sequence[Mark] = ()) -> None:
        with self.session_factory.begin() as session:
            mark_judged(session, marks, datetime.now(UTC))
            missing = {name for name, _ in judged.kept} | {key[0] for key in judged.minutes}
            missing -= self._target_ids.keys()
            if missing:  # a target's row, made at start or reload unless the database was away then
                targets = [t for t in self.judge.settings.targets if t.name in missing]
                rows = [(t.name, t.engine, t.base_url, t.model) for t in targets]
                self._target_ids.update(upsert_targets(session, rows, datetime.now(UTC)))
            write_traffic(session, self._target_ids, judged.kept, judged.minutes)
