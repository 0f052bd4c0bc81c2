"""Which replica consumes which partition of the traffic stream, decided in a JetStream KV bucket.

Each deployment's records are in one partition (the tap hashes their ``api_base``), and each
partition is consumed by one replica at a time, so a deployment's fingerprint window lives in one
place. NATS is the only arbiter (nats-server 2.9 has no consumer priority groups; no database
round is needed): in the bucket (``traffic.jetstream.bucket``, every key living ``LEASE_SECONDS``
after its last write) each replica

- heartbeats ``replica.<id>`` every ``STEP_SECONDS``; the live replicas are the keys present;
- ranks the live replicas for each partition by a hash of (replica, partition) and takes the
  partitions it tops (rendezvous hashing: a replica that joins or dies moves only its share);
- claims such a partition's key ``partition.<n>`` with *create* (only if absent) and keeps it with
  *update* at the revision it holds (compare-and-set), every step; it consumes the partition only
  while it holds the claim;
- releases (stops consuming, finishes the batch in hand, then deletes the key at its revision) a
  partition it no longer tops, which the new top replica creates at its next step.

A replica that dies stops writing: its keys lapse within a lease and the survivors claim its
partitions; what it had pulled and not acknowledged is delivered again after ``ack_wait``, and
``traffic_judged`` keeps a record judged before the death from being judged twice. A claim whose
update fails (the lease lapsed under a stalled replica and another took it) is given up at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable

from nats.js.errors import APIError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

log = logging.getLogger("kvcanary.traffic")

#: A key not written for this long is gone: the bucket's TTL (a replica's heartbeat, a claim).
LEASE_SECONDS = 6.0
#: Heartbeats and claim refreshes come this often: three to a lease.
STEP_SECONDS = LEASE_SECONDS / 3
REPLICA_KEY = "replica."
CLAIM_KEY = "partition."
#: JetStream's error for a write expecting another last revision (``JSStreamWrongLastSequenceErrF``).
WRONG_LAST_SEQUENCE = 10071


def kv_safe(replica: str) -> str:
    """Return ``replica`` made of the characters a KV key may hold."""
    return re.sub(r"[^-_=A-Za-z0-9]", "-", replica)[:200]


def owner_of(partition: int, live: Iterable[str]) -> str:
    """Return the live replica that is to consume ``partition`` (rendezvous hashing)."""
    return max(live, key=lambda replica: _weight(replica, partition))


def _weight(replica: str, partition: int) -> int:
    digest = hashlib.blake2b(f"{replica}\0{partition}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Partitions:
    """This replica's share of the partitions; ``start(n)`` begins consuming partition ``n`` and
    ``stop(n)`` returns once its consumer has finished (its last batch acknowledged)."""

    def __init__(
        self,
        kv: KeyValue,
        replica: str,
        count: int,
        start: Callable[[int], None],
        stop: Callable[[int], Awaitable[None]],
    ):
        self.kv = kv
        self.id = kv_safe(replica)
        self.count = count
        self._start = start
        self._stop = stop
        #: Partitions this replica holds the claim of, with the revision it holds.
        self.claims: dict[int, int] = {}
        self.live: tuple[str, ...] = (self.id,)

    async def step(self) -> None:
        """Heartbeat, read who is alive, and claim, keep or release partitions accordingly."""
        await self.kv.put(REPLICA_KEY + self.id, b"alive")
        live = await self._live()
        if live != self.live:
            log.info(
                "traffic stream: %d replica(s) live (%s); this one is %s", len(live), ", ".join(live), self.id
            )
        self.live = live
        mine = {n for n in range(self.count) if owner_of(n, live) == self.id}
        gone = [self._release(n) for n in sorted(set(self.claims) - mine)]
        await asyncio.gather(*gone, *(self._hold(n) for n in sorted(mine)))

    async def leave(self) -> None:
        """Release every partition and the heartbeat, so the others take over at their next step."""
        await asyncio.gather(*(self._release(n) for n in sorted(self.claims)))
        await self.kv.delete(REPLICA_KEY + self.id)

    async def _live(self) -> tuple[str, ...]:
        # A watcher on the heartbeats' subjects, not keys(filters=...): nats-py matches those
        # filters as substrings, and the server (2.9) filters one subject only.
        watcher = await self.kv.watch(REPLICA_KEY + ">", meta_only=True, ignore_deletes=True)
        live = {self.id}
        try:
            async for entry in watcher:
                if entry is None:  # the end of what is stored now
                    break
                live.add(entry.key.removeprefix(REPLICA_KEY))
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves it unannotated
        return tuple(sorted(live))

    async def _hold(self, n: int) -> None:
        key = f"{CLAIM_KEY}{n}"
        held = self.claims.get(n)
        try:
            if held is None:
                self.claims[n] = await self.kv.create(key, self.id.encode())
                self._start(n)
            else:
                self.claims[n] = await self.kv.update(key, self.id.encode(), last=held)
        except KeyWrongLastSequenceError:
            if held is not None:  # the lease lapsed (NATS was away, or this replica stalled): stop now
                log.info("traffic stream: the claim of partition %d lapsed; stopping its consumer", n)
                del self.claims[n]
                await self._stop(n)
            # else: another replica still holds it (it releases it at its next step, or its lease lapses)

    async def _release(self, n: int) -> None:
        revision = self.claims.pop(n)
        await self._stop(n)  # its batch in hand acknowledged before another replica may start
        try:
            await self.kv.delete(f"{CLAIM_KEY}{n}", last=revision)
        except APIError as exc:
            if exc.err_code != WRONG_LAST_SEQUENCE:
                raise
            # else it lapsed, and may be another's now: nothing of ours to delete
