"""Several ``kvcanary serve`` processes on one PostgreSQL divide the probe work between them.

Each replica keeps a heartbeat row in ``monitor_replica`` (an UPSERT every few seconds) and reads
back the rows seen within the last lease. Each (target, probe) pair belongs to the live replica
with the highest hash of (replica id, pair): rendezvous hashing. Every replica computes the same
answer from the same rows without talking to the others; a replica that joins takes about 1/N of
the pairs and moves nothing else; one that is killed stops its heartbeat and, once its row is older
than the lease, its pairs fall to the survivors at their next heartbeat. PostgreSQL is the only
arbiter: there is no election and no lock to lose.

Correctness does not rest on this: incidents open by a partial unique index and change by
compare-and-set, and the paging outbox is claimed by compare-and-set, so a pair run twice during a
membership change counts twice but opens one incident and pages once. This only keeps each probe
running about once per interval overall. SQLite is one process: it owns everything.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.storage.db import utcnow
from kvcanary.monitor.storage.models import MonitorReplica

log = logging.getLogger("kvcanary.replicas")

#: A replica whose heartbeat is older than this is gone: its pairs move.
LEASE_SECONDS = 15.0
#: Heartbeats come this often: three to a lease, so one late beat loses nothing.
HEARTBEAT_SECONDS = LEASE_SECONDS / 3


class Membership:
    """This replica's view of who is alive, and which pairs are its own."""

    def __init__(self, session_factory: sessionmaker[Session], *, shared: bool, url: str = ""):
        """``shared``: the database can be shared (PostgreSQL); without it this replica owns all.
        ``url``: where this replica's API is, as its heartbeat row says (for the operator)."""
        self.session_factory = session_factory
        self.shared = shared
        self.url = url
        self.id = f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"
        self.started_at = utcnow()
        self.live: tuple[str, ...] = (self.id,)

    def owner(self, target: str, kind: str) -> str:
        """Return the id of the live replica whose (target, kind) is to run."""
        if len(self.live) <= 1:
            return self.id
        pair = f"{target}\0{kind}".encode()
        return max(self.live, key=lambda replica: _weight(replica, pair))

    def owns(self, target: str, kind: str) -> bool:
        """Return True when (target, kind) is this replica's to run."""
        return self.owner(target, kind) == self.id

    def heartbeat(self, now: datetime | None = None) -> None:
        """Say this replica is alive and read who else is; keep the last view when the database is away."""
        if not self.shared:
            return
        now = now or utcnow()
        values = {"id": self.id, "host": socket.gethostname()[:255], "pid": os.getpid(),
                  "started_at": self.started_at, "seen_at": now, "url": self.url}  # fmt: skip
        stmt = postgresql.insert(MonitorReplica).values(**values)
        stmt = stmt.on_conflict_do_update(index_elements=["id"], set_={"seen_at": now})
        alive = now - timedelta(seconds=LEASE_SECONDS)
        with self.session_factory() as session, session.begin():
            session.execute(stmt)
            ids = list(session.scalars(select(MonitorReplica.id).where(MonitorReplica.seen_at >= alive)))
            # Rows of replicas gone for good: keep the table as small as the fleet.
            session.execute(delete(MonitorReplica).where(MonitorReplica.seen_at < now - timedelta(hours=1)))
        live = tuple(sorted(set(ids) | {self.id}))
        if live != self.live:
            log.info("replicas: %d live (%s); this one is %s", len(live), ", ".join(live), self.id)
        self.live = live

    def beat(self) -> bool:
        """Heartbeat; return whether the live replicas changed. While the database is away the last
        view is kept (the next beat tries again)."""
        before = self.live
        try:
            self.heartbeat()
        except Exception as exc:
            log.warning("replica heartbeat failed (%s); keeping the last view", type(exc).__name__)
        return self.live != before

    def counts(self, settings: Settings) -> tuple[int, int]:
        """Return how many replicas are live, and how many probe jobs of ``settings`` are this one's."""
        owned = sum(self.owns(t.name, k) for t in settings.targets for k in t.probes)
        return len(self.live), owned

    def leave(self) -> None:
        """Delete this replica's row, so the others take its pairs at their next heartbeat."""
        if not self.shared:
            return
        try:
            with self.session_factory() as session, session.begin():
                session.execute(delete(MonitorReplica).where(MonitorReplica.id == self.id))
        except Exception:  # the lease ends it anyway
            log.warning("could not remove this replica's heartbeat row; it lapses in %.0fs", LEASE_SECONDS)


def _weight(replica: str, pair: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(replica.encode() + b"\0" + pair, digest_size=8).digest(), "big")
