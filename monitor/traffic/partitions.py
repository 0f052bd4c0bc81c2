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

The bucket is trusted: whoever can write it can starve every replica (claims kept under a name no
replica has, or heartbeats of hundreds of replicas that do not exist, which then top most
partitions and never claim them). Only monitors may touch it (NATS permissions: the taps publish
to their subjects and nothing more; ``docs/nats-permissions.conf``), and each replica checks, at
every step, what it reads for what no set of real replicas writes (:meth:`Partitions.anomalies`,
the ``kvcanary_traffic_stream_bucket_anomalies`` metric): more live replicas than ``max_replicas``;
claims held for over a lease by a replica without a heartbeat (a replica that stalls past its
lease loses its heartbeat a moment before its claims, written later in the same step); partitions
this replica tops that another has held for over a lease (a hand-over takes one step). A step
reads at most ``MAX_KEYS_READ`` keys, and a log line names at most ``LOGGED_REPLICAS`` replicas,
however many keys a writer adds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable

from nats.js.errors import APIError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from kvcanary.monitor.metrics.stream import ANOMALIES

log = logging.getLogger("kvcanary.traffic")

#: A key not written for this long is gone: the bucket's TTL (a replica's heartbeat, a claim).
LEASE_SECONDS = 6.0
#: Heartbeats and claim refreshes come this often: three to a lease.
STEP_SECONDS = LEASE_SECONDS / 3
REPLICA_KEY = "replica."
CLAIM_KEY = "partition."
#: JetStream's error for a write expecting another last revision (``JSStreamWrongLastSequenceErrF``).
WRONG_LAST_SEQUENCE = 10071
#: Live replicas past which the bucket is not believed (``traffic.jetstream.max_replicas``'s default).
MAX_REPLICAS = 64
#: Keys a step reads from the bucket at most: a writer filling it costs each replica a bounded read.
MAX_KEYS_READ = 1024
#: Replica ids a log line names at most; the rest are counted.
LOGGED_REPLICAS = 8


def kv_safe(replica: str) -> str:
    """Return ``replica`` made of the characters a KV key may hold."""
    return re.sub(r"[^-_=A-Za-z0-9]", "-", replica)[:200]


def owner_of(partition: int, live: Iterable[str]) -> str:
    """Return the live replica that is to consume ``partition`` (rendezvous hashing)."""
    return max(live, key=lambda replica: _weight(replica, partition))


def named(replicas: Iterable[str]) -> str:
    """Return ``replicas`` for a log line: the first ``LOGGED_REPLICAS``, then how many more."""
    replicas = list(replicas)
    shown = ", ".join(replicas[:LOGGED_REPLICAS])
    more = len(replicas) - LOGGED_REPLICAS
    return f"{shown} and {more} more" if more > 0 else shown


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
        *,
        max_replicas: int = MAX_REPLICAS,
    ):
        self.kv = kv
        self.id = kv_safe(replica)
        self.count = count
        self.max_replicas = max_replicas
        self._start = start
        self._stop = stop
        #: Partitions this replica holds the claim of, with the revision it holds.
        self.claims: dict[int, int] = {}
        self.live: tuple[str, ...] = (self.id,)
        #: Since when (monotonic) each partition this replica tops has been claimed by another.
        self._withheld_since: dict[int, float] = {}
        #: Since when (monotonic) each partition has been claimed by a replica without a heartbeat.
        self._orphaned_since: dict[int, float] = {}
        self._anomalies: dict[str, int] = dict.fromkeys(ANOMALIES, 0)

    async def step(self) -> None:
        """Heartbeat, read who is alive, and claim, keep or release partitions accordingly."""
        await self.kv.put(REPLICA_KEY + self.id, b"alive")
        live, holders = await self._read()
        if live != self.live:
            log.info(
                "traffic stream: %d replica(s) live (%s); this one is %s", len(live), named(live), self.id
            )
        self.live = live
        mine = {n for n in range(self.count) if owner_of(n, live) == self.id}
        self._audit(holders, mine)
        gone = [self._release(n) for n in sorted(set(self.claims) - mine)]
        await asyncio.gather(*gone, *(self._hold(n) for n in sorted(mine)))

    async def leave(self) -> None:
        """Release every partition and the heartbeat, so the others take over at their next step."""
        await asyncio.gather(*(self._release(n) for n in sorted(self.claims)))
        await self.kv.delete(REPLICA_KEY + self.id)

    def anomalies(self) -> dict[str, int]:
        """Return what the last step read in the bucket that no set of real replicas writes, by
        kind (``ANOMALIES``; 0 each in a sound bucket, the module doc): live replicas beyond
        ``max_replicas``, partitions claimed by a replica without a heartbeat, and partitions this
        replica tops that another has held for over a lease."""
        return dict(self._anomalies)

    async def _read(self) -> tuple[tuple[str, ...], dict[int, str]]:
        """Return the live replicas (this one among them) and who claims each partition, from at
        most ``MAX_KEYS_READ`` keys of the bucket."""
        # One watcher on every key, not keys(filters=...): nats-py matches those filters as
        # substrings, and the server (2.9) filters one subject only.
        watcher = await self.kv.watch(">", ignore_deletes=True)
        live = {self.id}
        holders: dict[int, str] = {}
        try:
            read = 0
            async for entry in watcher:
                read += 1
                if entry is None or read > MAX_KEYS_READ:  # the end of what is stored now, or of the read
                    break
                if entry.key.startswith(REPLICA_KEY):
                    # kv_safe: what a writer put in the bucket is logged, and must print as one line
                    live.add(kv_safe(entry.key.removeprefix(REPLICA_KEY)))
                elif (n := _partition(entry.key)) is not None and n < self.count:
                    holders[n] = kv_safe((entry.value or b"").decode(errors="replace"))
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves it unannotated
        return tuple(sorted(live)), holders

    def _audit(self, holders: dict[int, str], mine: set[int]) -> None:
        """Count the bucket's anomalies (:meth:`anomalies`) from this step's read; say when they
        begin and end."""
        now = time.monotonic()
        taken = {n for n in mine if n in holders and n not in self.claims}
        self._withheld_since = {n: self._withheld_since.get(n, now) for n in taken}
        orphaned = {n: holder for n, holder in holders.items() if holder not in self.live}
        self._orphaned_since = {n: self._orphaned_since.get(n, now) for n in orphaned}
        before = any(self._anomalies.values())
        self._anomalies = {
            "replicas_over_limit": max(0, len(self.live) - self.max_replicas),
            # Over a lease: a stalled replica's claims, written later in its step, outlive its heartbeat.
            "claims_without_heartbeat": _over_a_lease(self._orphaned_since, now),
            "partitions_withheld": _over_a_lease(self._withheld_since, now),
        }
        if any(self._anomalies.values()) and not before:
            found = ", ".join(f"{kind} {count}" for kind, count in self._anomalies.items())
            log.warning("traffic stream: the partitions' bucket holds what no replica wrote (%s; claims by "
                        "replicas without a heartbeat: %s): something other than the monitors writes it",
                        found, named(sorted(set(orphaned.values()))) or "none")  # fmt: skip
        elif before and not any(self._anomalies.values()):
            log.info("traffic stream: the partitions' bucket holds only what the replicas wrote again")

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


def _over_a_lease(since: dict[int, float], now: float) -> int:
    """Return how many partitions have been in a state since over a lease before ``now``."""
    return sum(1 for began in since.values() if now - began > LEASE_SECONDS)


def _partition(key: str) -> int | None:
    """Return the partition a claim's key names, or None (another key, or no number)."""
    number = key.removeprefix(CLAIM_KEY)
    return int(number) if number != key and number.isdigit() and len(number) < 7 else None
