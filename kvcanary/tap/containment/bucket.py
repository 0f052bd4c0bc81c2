"""The quarantine set watched in the monitors' JetStream KV bucket, for gateways whose records go
to NATS (``KVCANARY_TAP_URL=nats://...``): a change reaches every gateway replica as it is put,
and no gateway polls a monitor (``monitor/containment/bucket.py`` puts it).

:class:`BucketWatch` is a :class:`~kvcanary.tap.containment.watch.QuarantineWatch` whose thread, instead
of polling HTTP, runs an event loop of its own with a NATS connection and a watch of the bucket's
one key: the bucket's current value first, then each new one, each taken as an answer is
(:meth:`~kvcanary.tap.containment.watch.QuarantineWatch.take`): a set the monitors signed and newer
than the one held, or refused, counted and the last set kept. Whoever else can write the bucket
(a tap host on a NATS without permissions) moves no gateway. What a request reads is the same:
memory only. When NATS cannot be reached, the bucket is not there yet (no monitor has started),
holds no set the monitors signed, or the connection drops (pings every ``PING_SECONDS`` find a
silent one), the last set is kept, one line says so (and one when a set is read again), the
gateway's ``kvcanary_tap_quarantine_unreadable`` is 1, and the watch starts again every
``poll_seconds``, from the bucket's current value. A value deleted from the bucket (by hand) is not
taken as an empty set: only a monitor's put changes it.

The monitors cannot see a watch, so the tap says what it applies: on the watch's connection it
publishes ``{"revision", "generated_at", "key_id", "stale"}`` of the set it holds on
``<bucket>.applied.<gateway>`` (``kvcanary.wire.applied_subject``) when it takes a set and every
``ACK_SECONDS``; the monitors count each as a read by that gateway
(``kvcanary_quarantine_set_reads_total``, ``KVCanaryContainmentUnapplied``).

The tap's NATS user needs the rights ``docs/nats-permissions.conf`` gives it: to ask JetStream for
the bucket's stream and an ordered consumer of it, to hear on ``_INBOX`` and to publish on
``<bucket>.applied.>``; never to write the bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.js.kv import KV_DEL, KV_PURGE

from kvcanary.tap.containment.signed import PublicKeys
from kvcanary.tap.containment.watch import STALE_SECONDS, QuarantineWatch, log
from kvcanary.wire import QUARANTINE_BUCKET, QUARANTINE_KEY, applied_subject

CONNECT_TIMEOUT_SECONDS = 2
#: Seconds between the watch's pings to NATS; two unanswered close the connection (watched again).
PING_SECONDS = 2
#: How often a watch tells the monitors what it applies though nothing changed: a gateway counts as
#: reading the set while they hear it within a few of these.
ACK_SECONDS = 10.0


class BucketWatch(QuarantineWatch):
    """The quarantine set as the bucket holds it, kept fresh by a daemon thread (module doc)."""

    def __init__(
        self,
        servers: str,
        token: str | None = None,
        *,
        keys: PublicKeys,
        gateway: str = "",
        user: str | None = None,
        bucket: str = QUARANTINE_BUCKET,
        poll_seconds: float = 1.0,
        stale_seconds: float = STALE_SECONDS,
        start: bool = True,
    ):
        """``servers``: NATS's URL; ``token``: its auth token, or ``user``'s password; ``keys``:
        the monitors' public keys by id; ``gateway``: this gateway's name, what it acknowledges
        under ("": it acknowledges nothing); ``poll_seconds``: how soon a lost watch is made again;
        ``start``: now (else on the first lookup)."""
        super().__init__(
            servers, "", keys=keys, gateway=gateway, poll_seconds=poll_seconds,
            stale_seconds=stale_seconds, start=False,
        )  # fmt: skip
        self.servers, self.bucket = servers, bucket
        self._acked_at = float("-inf")  # time.monotonic() of the last acknowledgement published
        self.url = f"{servers} (bucket {bucket})"  # what the log lines name
        self._credentials: dict[str, Any] = (
            {"user": user, "password": token or ""} if user else {"token": token} if token else {}
        )
        if start:
            self._start_polling()

    def poll_once(self) -> bool:
        """Read the bucket's current value once (a watch's first step; for tests and tools)."""
        return asyncio.run(self._watch(once=True))

    def _loop(self) -> None:
        asyncio.run(self._watch_until_closed())

    async def _watch_until_closed(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # said by _watch; the set stays the last known
                await self._watch(once=False)
            await asyncio.to_thread(self._stop.wait, self.poll_seconds)

    async def _watch(self, *, once: bool) -> bool:
        """Watch the set until closed, the connection lost, or (``once``) the current value read;
        return whether a value was taken. Failures are noted (logged once) and raised."""
        client: Client | None = None
        try:
            client = await nats.connect(
                self.servers, **self._credentials, name="kvcanary-tap-quarantine",
                connect_timeout=CONNECT_TIMEOUT_SECONDS, allow_reconnect=False,
                error_cb=_quiet, max_reconnect_attempts=0,
                # A connection dead without a word (a half-open socket) is found within seconds,
                # not nats-py's default of minutes: the set would go stale with nothing said.
                ping_interval=PING_SECONDS, max_outstanding_pings=2,
            )  # fmt: skip
            kv = await client.jetstream(timeout=self.timeout_seconds).key_value(self.bucket)
            watcher = await kv.watch(QUARANTINE_KEY)
            return await self._follow(client, watcher, once)
        except Exception as exc:
            self._note_failure(exc if str(exc) else RuntimeError(type(exc).__name__))
            raise
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), 2)

    async def _follow(self, client: Client, watcher: Any, once: bool) -> bool:
        taken = False
        while not self._stop.is_set():
            try:
                entry = await watcher.updates(timeout=self.poll_seconds)
            except nats.errors.TimeoutError:
                if not client.is_connected:
                    raise ConnectionError("the connection to NATS was lost") from None
                self.check_stale()
                await self._acknowledge(client, due=True)
                continue
            if entry is None:  # the bucket's current value is delivered (or it holds none)
                if taken:
                    self._read_again()
                else:  # nothing the monitors signed there: the set held is not theirs (yet)
                    self._note_failure(ValueError("the bucket holds no quarantine set the monitors signed"))
                if once:
                    return taken
                continue
            if entry.operation in (KV_DEL, KV_PURGE) or entry.value is None:
                continue
            held = self.current
            if self.take(entry.value):
                taken = True
                self._read_again()
            # Checked on every value too: a writer putting values without pause never lets the
            # update's timeout come.
            self.check_stale()
            await self._acknowledge(client, due=self.current is held)
        return taken

    async def _acknowledge(self, client: Client, *, due: bool) -> None:
        """Tell the monitors which set this gateway applies: now, or (``due``) once
        ``ACK_SECONDS`` passed since the last time; nothing before a set was taken."""
        if not self.gateway or self.current.revision < 0:
            return
        if due and time.monotonic() - self._acked_at < ACK_SECONDS:
            return
        held = self.current
        said = {"revision": held.revision, "generated_at": held.generated_at, "key_id": held.key_id,
                "stale": self.stale}  # fmt: skip
        with contextlib.suppress(Exception):  # a lost connection is found by the next update
            await client.publish(applied_subject(self.bucket, self.gateway), json.dumps(said).encode())
            self._acked_at = time.monotonic()

    def _read_again(self) -> None:
        if self.failing:
            self.failing = False
            log.warning("kvcanary tap: the quarantine is read from %s again", self.url)


async def _quiet(exc: Exception) -> None:
    """nats-py's error callback: the watch says what failed, once, itself."""
