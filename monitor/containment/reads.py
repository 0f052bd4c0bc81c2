"""Which gateways read the quarantine set: a quarantine no gateway applies protects no customer.

Over HTTP each ``GET /api/v1/quarantine`` is a read by the gateway its ``Kvcanary-Gateway`` header
names; over NATS the monitors cannot see a watch of the bucket, so each tap acknowledges the set it
applies on ``<bucket>.applied.<gateway>`` (``kvcanary/tap/containment/bucket.py``), which every
replica hears. Both say which set the gateway holds (over HTTP the ``Kvcanary-Quarantine-Held``
header of each read). :class:`SetReads` keeps, per gateway, how many reads this replica saw (by
transport) and when it last saw one, by the key of the set the gateway held (after a key rotation,
which gateways follow the new key: one without it keeps the old key's set). Each replica sees
only its own HTTP reads: a rule over them takes ``max`` across replicas
(``KVCanaryContainmentUnapplied``).

At most ``MAX_GATEWAYS`` names are kept; reads under any other count as ``OVERFLOW``, and a key id
the monitors do not hold (their signing key and the keys they trust) counts as ``UNKNOWN_KEY``, so
a caller naming a new gateway or a new key each time cannot grow the monitor's series without bound.

:attr:`SetReads.held_newest` is the highest revision a gateway said it holds of a set signed by a
key of ours: above the set this replica reads from the database, it says that database is older
than what the gateways apply (restored from a backup: ``containment/__init__.py`` says so). It is a
claim no signature backs, so it only ever reaches a log line, and a revision more than
``CLAIM_AHEAD_MS`` past the time (the monitors number changes by it) is not taken: one claim of
10¹⁹ would hide every real one.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvcanary.wire import GATEWAY_PATTERN

MAX_GATEWAYS = 256
#: The gateway reads are counted under past ``MAX_GATEWAYS`` names, and under without a valid name.
OVERFLOW = "(more)"
UNNAMED = "(unnamed)"
#: The key id reads are counted under when the set the gateway held was signed by no key of ours.
UNKNOWN_KEY = "(unknown)"
#: How far past the time a held revision may be and still be taken (a replica's clock ahead).
CLAIM_AHEAD_MS = 3_600_000


@dataclass(frozen=True)
class Read:
    """How many reads of a (gateway, transport, key id) this replica saw, and the last one's time."""

    count: int
    last_at: float


class SetReads:
    """Reads of the quarantine set by gateway (module doc); thread-safe."""

    def __init__(self, known_keys: Callable[[], Collection[str]]) -> None:
        """``known_keys``: the ids of the keys whose sets are the monitors' (the signer's ``trusted``)."""
        self.known_keys = known_keys
        self._reads: dict[tuple[str, str, str], Read] = {}
        self._gateways: set[str] = set()
        self._lock = threading.Lock()
        #: The highest revision a gateway said it holds of a set one of our keys signed (-1: none).
        self.held_newest = -1

    def note(self, gateway: str | None, via: str, key_id: str, revision: int | None = None) -> None:
        """Count a read by ``gateway`` over ``via`` (http, nats), which held a set signed by
        ``key_id`` ("": none yet) at ``revision`` (None: not said)."""
        name = gateway if gateway and re.fullmatch(GATEWAY_PATTERN, gateway) else UNNAMED
        key_id = key_id if not key_id or key_id in self.known_keys() else UNKNOWN_KEY
        with self._lock:
            ours = key_id not in ("", UNKNOWN_KEY)
            if ours and revision is not None and revision <= time.time() * 1000 + CLAIM_AHEAD_MS:
                self.held_newest = max(self.held_newest, revision)
            if name not in self._gateways:
                if len(self._gateways) >= MAX_GATEWAYS:
                    name = OVERFLOW
                self._gateways.add(name)
            key = (name, via, key_id)
            found = self._reads.get(key)
            self._reads[key] = Read((found.count if found else 0) + 1, time.time())

    def counts(self) -> dict[tuple[str, str], int]:
        """Return the reads by (gateway, transport)."""
        with self._lock:
            reads = list(self._reads.items())
        found: dict[tuple[str, str], int] = {}
        for (gateway, via, _), read in reads:
            found[gateway, via] = found.get((gateway, via), 0) + read.count
        return found

    def last(self) -> dict[tuple[str, str], float]:
        """Return when each gateway last read a set signed by each key (epoch seconds)."""
        with self._lock:
            reads = list(self._reads.items())
        found: dict[tuple[str, str], float] = {}
        for (gateway, _, key), read in reads:
            found[gateway, key] = max(found.get((gateway, key), 0.0), read.last_at)
        return found
