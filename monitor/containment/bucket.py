"""The quarantine set put in a JetStream KV bucket (``traffic.jetstream.quarantine_bucket``), where
the taps of gateways whose records go to NATS watch it (``kvcanary/tap/containment/bucket.py``)
instead of polling ``GET /api/v1/quarantine``: a change reaches every gateway replica when it is
put, and hundreds of gateway processes cost the monitors nothing.

The set is the monitors' alone. Every replica runs the containment rules and, once it has read the
pools the guards need, offers the set it read after each round (``monitor/app.py``, every 0.5 s):
when it differs from what this replica put last (its times aside), and every ``RECHECK_SECONDS``
anyway, it reads the bucket's value, opens it with the monitors' public keys
(``containment/signing.py``) and

- puts its own set, signed, over a value the monitors did not sign (unsigned, an unknown key, a bad
  signature, not a set) or an older set of theirs put back (a revision and time below the newest
  this replica saw there): each such value is counted (``foreign``, by reason:
  ``kvcanary_quarantine_bucket_foreign_total``), and one line a ``FOREIGN_QUIET_SECONDS`` episode
  says it: something other than the monitors writes the bucket;
- puts its own over a missing value, or a set of theirs read at an older ``revision`` (the newest
  quarantine change's: it only grows); leaves a newer revision for this replica to catch up with
  (or, after a database restored from a backup, for the next change, numbered above it);
- at the same revision, puts its own when its set changed and differs (its guards: each replica
  reads the pools itself), or when the set held is ``renew_seconds`` old (re-signed, so the taps
  see it move forward and its ``expires_at`` never passes while a monitor runs).

A set put is generated after the one it replaces (``generated_at`` at least a millisecond past
it, whatever this replica's clock says), so the values the monitors put only move forward, and a
put over one of theirs is a compare-and-set on the value read: two replicas never put an older set
over a newer one. Over a foreign value the put is plain: a writer putting values without pause
cannot keep the monitors' set out. The bucket keeps the last value and no TTL: a monitor restart,
or every monitor gone, leaves the set as it was, which is what a gateway must keep. A put that
fails (NATS away) is tried again the next round; one line says it, once per outage.

The replica also hears the taps' acknowledgements (``<bucket>.applied.<gateway>``) on the same
connection and counts each as a read of the set by that gateway (``containment/reads.py``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from kvcanary.monitor.config.settings import ContainmentSigningConfig, JetStreamConfig
from kvcanary.monitor.containment.reads import SetReads
from kvcanary.monitor.containment.signing import SetSigner
from kvcanary.monitor.traffic.stream_setup import quarantine_bucket, why
from kvcanary.tap.containment.document import QuarantineSet
from kvcanary.tap.containment.signed import Refused
from kvcanary.wire import QUARANTINE_KEY, applied_subject

log = logging.getLogger("kvcanary.containment")

#: How often a replica reads the bucket's value though its own set did not change: a value lost,
#: deleted, forged or left older is put right within this.
RECHECK_SECONDS = 2.0
#: Foreign values this close together are one episode, said in one line.
FOREIGN_QUIET_SECONDS = 60.0
#: Reads and puts of one offer, at most, while other replicas put between them.
PUT_TRIES = 3
#: The most of an acknowledgement read.
MAX_ACK_BYTES = 1024

#: Why a value in the bucket is not the monitors': each counted from 0, so a rule sees the first.
FOREIGN_REASONS = ("unsigned", "unknown_key", "bad_signature", "malformed", "older")

#: (revision, generated) of a set: how the monitors' sets are ordered.
Order = tuple[int, float]


@dataclass(frozen=True)
class Held:
    """What the bucket holds: its sequence (0: never written), and the monitors' set (``document``,
    ``read``) or why it is not theirs (``foreign``: a refusal's reason); all None when empty."""

    seq: int
    document: dict[str, Any] | None = None
    read: QuarantineSet | None = None
    foreign: Refused | None = None


class QuarantineBucket:
    """Puts the monitors' signed quarantine set in the bucket (module doc). ``connection`` returns
    the replica's JetStream context while connected (``TrafficStream.connection``), else None;
    ``signer`` this monitor's signer (None: no key, nothing is put); ``signing`` the settings in
    force; ``reads`` counts the taps' acknowledgements."""

    def __init__(
        self,
        cfg: JetStreamConfig,
        connection: Callable[[], tuple[JetStreamContext, int] | None],
        signer: Callable[[], SetSigner | None],
        *,
        signing: Callable[[], ContainmentSigningConfig] = ContainmentSigningConfig,
        reads: SetReads | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.connection = connection
        self.signer = signer
        self.signing = signing
        self.reads = reads or SetReads(lambda: signed.trusted if (signed := signer()) is not None else ())
        self.clock = clock
        self._kv: KeyValue | None = None
        self._listening: Any = None  # the NATS client the acknowledgements are heard on
        self._put: str | None = None  # what this replica put (or found there) last, its times aside
        self._checked = float("-inf")  # when the bucket's value was last read
        self._newest: Order = (-1, 0.0)  # the newest of the monitors' sets seen there or put
        self._failing = False
        self._foreign_at = float("-inf")  # when a foreign value was last found
        self._foreign_seq = 0  # the last foreign value counted (each is counted once)
        #: Puts made since start (``/healthz``).
        self.puts = 0
        #: Foreign values found, by reason (``kvcanary_quarantine_bucket_foreign_total``).
        self.foreign: Counter[str] = Counter(dict.fromkeys(FOREIGN_REASONS, 0))

    async def publish(self, document: dict[str, Any]) -> bool:
        """Put ``document``, signed, where the module doc says to; return whether the bucket holds
        the monitors' set at least as new (False: NATS could not be asked, or there is no key)."""
        signer = self.signer()
        if signer is None:
            return False
        content = _content(document)
        changed = content != self._put
        if not changed and self.clock() - self._checked < RECHECK_SECONDS:
            return True
        connected = self.connection()
        if connected is None:
            return self._failed("not connected to NATS")
        try:
            if self._kv is None:
                self._kv = await quarantine_bucket(connected[0], self.cfg)
            await self._listen(connected[0])
            await self._offer(self._kv, signer, document, content, changed)
        except Exception as exc:  # NATS away, the bucket deleted: bound again next round
            self._kv = None
            return self._failed(why(exc))
        self._put = content
        if self._failing:
            self._failing = False
            log.warning("quarantine set: put in the bucket %s again", self.cfg.quarantine_bucket)
        return True

    async def _offer(
        self, kv: KeyValue, signer: SetSigner, document: dict[str, Any], content: str, changed: bool
    ) -> None:
        for _ in range(PUT_TRIES):
            held = await _held(kv, signer)
            self._checked = self.clock()
            after = self._after(held, document, content, changed)
            if after is None:
                return
            stamped = self._stamped(document, after)
            try:
                if held.foreign is not None:
                    await kv.put(QUARANTINE_KEY, signer.sign(stamped))
                else:
                    await kv.update(QUARANTINE_KEY, signer.sign(stamped), last=held.seq)
            except KeyWrongLastSequenceError:
                continue  # another replica put meanwhile: read what it put
            self.puts += 1
            self._newest = max(self._newest, (stamped["revision"], _epoch(stamped["generated_at"])))
            return

    def _after(self, held: Held, document: dict[str, Any], content: str, changed: bool) -> float | None:
        """Return the time the set put must be generated after (epoch seconds), or None: leave
        what the bucket holds (module doc)."""
        if held.foreign is not None:
            self._said_foreign(held, held.foreign)
            return self._newest[1]
        if held.read is None or held.document is None:
            return self._newest[1]
        order = (held.read.revision, held.read.generated)
        if order < self._newest:  # one of the monitors' sets, older than one seen there: put back
            self._said_foreign(held, Refused("older", f"revision {order[0]} put back over {self._newest[0]}"))
            return self._newest[1]
        self._newest = order
        if held.read.revision != document["revision"]:
            return held.read.generated if held.read.revision < document["revision"] else None
        if changed and _content(held.document) != content:
            return held.read.generated
        if time.time() - held.read.generated >= self.signing().renew_seconds:
            return held.read.generated
        return None

    def _stamped(self, document: dict[str, Any], after: float) -> dict[str, Any]:
        """Return ``document`` generated now, or a millisecond after ``after`` where this
        replica's clock is behind it, and expiring ``expires_seconds`` later."""
        generated = max(time.time(), after + 0.001)
        expires = generated + self.signing().expires_seconds
        return {**document, "generated_at": _iso(generated), "expires_at": _iso(expires)}

    def _said_foreign(self, held: Held, refused: Refused) -> None:
        """Count a foreign value once, and say it once an episode."""
        if held.seq == self._foreign_seq:
            return
        self._foreign_seq = held.seq
        self.foreign[refused.reason] += 1
        if self.clock() - self._foreign_at >= FOREIGN_QUIET_SECONDS:
            log.warning(
                "quarantine set: the bucket %s held a value the monitors did not put (%s); putting "
                "their set back. Something other than the monitors writes the bucket: the taps refuse "
                "such values, but find who (docs/nats-permissions.conf)",
                self.cfg.quarantine_bucket, refused,
            )  # fmt: skip
        self._foreign_at = self.clock()

    async def _listen(self, js: JetStreamContext) -> None:
        """Hear the taps' acknowledgements on the connection the set is put through (subscribed
        once per connection; nats-py subscribes again after a reconnect)."""
        # The traffic stream's client, which the JetStream context keeps as _nc: one connection per
        # replica, reconnected for ever, rather than one more of the containment's own.
        client = js._nc
        if self._listening is client:
            return
        await client.subscribe(applied_subject(self.cfg.quarantine_bucket, ">"), cb=self._applied)
        self._listening = client

    async def _applied(self, message: Msg) -> None:
        """Count a tap's acknowledgement as a read of the set by its gateway (the subject's tail)."""
        prefix = applied_subject(self.cfg.quarantine_bucket, "")
        gateway = message.subject.removeprefix(prefix)
        try:
            said = json.loads(message.data) if len(message.data) <= MAX_ACK_BYTES else None
        except ValueError:
            said = None
        said = said if isinstance(said, dict) else {}
        key, revision = said.get("key_id"), said.get("revision")
        if not isinstance(key, str) or re.fullmatch(r"[0-9a-f]{16}", key) is None:
            key = ""
        if not isinstance(revision, int) or isinstance(revision, bool) or revision < 0:
            revision = None  # how far ahead a claim may be is the reads' to judge
        self.reads.note(gateway, "nats", key, revision)

    def _failed(self, reason: str) -> bool:
        if not self._failing:
            self._failing = True
            log.warning("quarantine set: cannot put it in the bucket %s (%s); the taps watching it keep "
                        "the last set; trying every round", self.cfg.quarantine_bucket, reason)  # fmt: skip
        return False


def _content(document: dict[str, Any]) -> str:
    """What two sets are compared by: everything but when each was made and expires."""
    times = ("generated_at", "expires_at")
    return json.dumps({k: v for k, v in document.items() if k not in times}, sort_keys=True)


async def _held(kv: KeyValue, signer: SetSigner) -> Held:
    """Return what the bucket holds, opened with the monitors' keys."""
    try:
        entry = await kv.get(QUARANTINE_KEY)
    except KeyNotFoundError:
        return Held(0)
    except KeyDeletedError as exc:  # deleted by hand: the delete's sequence is the one to put over
        return Held(int(exc.entry.revision or 0) if exc.entry is not None else 0)
    seq = int(entry.revision or 0)
    if not entry.value:
        return Held(seq)
    try:
        document, read = signer.open(entry.value)
    except Refused as refused:
        return Held(seq, foreign=refused)
    return Held(seq, document, read)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()
