"""Containment: what the monitor tells every gateway to do about a deployment, and nothing else.

The room's parts:

- ``rules.py``: which targets are quarantined (an incident puts one on, recovery or an operator
  lifts it), each change a ``quarantine_change`` row;
- ``guards.py``: the admission guard's facts, each guarded target's smallest admitting KV pool;
- ``document.py``: the one set the gateways read, the quarantines and the guards;
- ``signing.py``: that set signed with the monitors' key, so that no one else can move a gateway;
- ``bucket.py``: that set put in the JetStream KV bucket the taps of gateways on NATS watch, and
  put back over any value the monitors did not put;
- ``reads.py``: which gateways read the set, and when last;
- ``verification.py``: a suspected leak checked at once by the probes that can prove it; with an
  operator's word on one (:meth:`Containment.confirm`, :meth:`Containment.dismiss`), what decides
  whether a suspicion moves traffic.

:class:`Containment` is the one interface the composition root (``monitor/app.py``), the API
(``api/containment.py``) and the CLI call. The gateway's half is ``kvcanary/tap/containment/``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.containment.document import quarantine_set
from kvcanary.monitor.containment.guards import REFRESH_SECONDS, AdmissionFacts, GuardFacts
from kvcanary.monitor.containment.reads import SetReads
from kvcanary.monitor.containment.rules import Quarantine, QuarantineRead, QuarantineRules, UnknownTarget
from kvcanary.monitor.containment.signing import SetSigner, signer_of
from kvcanary.monitor.containment.verification import Verifier
from kvcanary.monitor.incidents import NotSuspected, confirm, dismiss
from kvcanary.monitor.metrics.containment import ContainmentReport

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from kvcanary.monitor.containment.bucket import QuarantineBucket
    from kvcanary.monitor.recording.pending import PendingResult
    from kvcanary.monitor.traffic.facts import TargetFacts

__all__ = ["Containment", "GuardFacts", "NotSuspected", "Quarantine", "UnknownTarget", "Verifier"]

log = logging.getLogger("kvcanary.containment")

#: How often the quarantine rules are applied (and at once when a recording changed an incident):
#: what bounds how late a replica that did not record the verdict serves the new set (a gateway's
#: poll and its requests in flight come on top, within the 2 s promise).
ROUND_SECONDS = 0.5

#: A housekeeping job: its name, what it runs, every how many seconds.
Job = tuple[str, Callable[[], Awaitable[None]], float]


#: How long a read of the set waits for the admission guards' first reading before it is refused:
#: under the 2 s a tap gives a read, so it hears the refusal rather than its own timeout.
FIRST_READ_WAIT_SECONDS = 1.0
#: A database older than the gateways' set is said at most once in this long.
OLDER_QUIET_SECONDS = 60.0


class GuardsUnread(Exception):
    """The set cannot be served yet: the admission guards' pools were never read."""


class Containment:
    """The quarantine rules, the guards' facts and, where the traffic stream is used, the bucket,
    behind one interface.

    ``settings`` returns the settings in force; ``clients`` are the targets' clients by name (kept
    up to date by reloads) and ``facts`` the traffic judge's, which read and keep each node's pool;
    ``on_change`` is called (from a worker thread) after the set changed; ``connection`` returns
    the replica's JetStream context while connected, where the set is put in a bucket; ``signer``
    signs the set (``containment/signing.py``'s ``signer_of``; None: no key, and no set is served
    or put until a reload brings one).
    """

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        settings: Callable[[], Settings],
        clients: Mapping[str, Any],
        facts: TargetFacts,
        *,
        on_change: Callable[[], None] | None = None,
        connection: Callable[[], tuple[JetStreamContext, int] | None] | None = None,
        verifier: Verifier | None = None,
        signer: SetSigner | None = None,
    ):
        self.settings = settings
        self.session_factory = session_factory
        #: Runs the proving probes when a suspicion is recorded (``containment/verification.py``).
        self.verifier = verifier
        #: Signs the set (None: no key, and none needed: no set is served or put).
        self.signer = signer
        if self.signer is None:
            log.info("containment: no signing key (containment_signing.key_env): the gateways read no "
                     "quarantine set until one is set")  # fmt: skip
        self.rules = QuarantineRules(session_factory, settings, on_change)
        self.guards = AdmissionFacts(settings, clients, facts)
        self.reads = SetReads(lambda: self.signer.trusted if self.signer is not None else ())
        self.bucket: QuarantineBucket | None = None
        if connection is not None:
            from kvcanary.monitor.containment.bucket import QuarantineBucket  # nats-py only when used

            self.bucket = QuarantineBucket(
                settings().traffic.jetstream, connection, lambda: self.signer,
                signing=lambda: self.settings().containment_signing, reads=self.reads,
            )  # fmt: skip
        self._round: asyncio.Task[None] | None = None
        self._said_older = -1  # the highest held revision said to be above the database's
        self._said_older_at = float("-inf")

    @property
    def known(self) -> list[Quarantine]:
        """The set as the last round left it: what ``/metrics`` exports without a read."""
        return self.rules.known

    def jobs(self) -> list[Job]:
        """Return the housekeeping jobs that keep the set current."""
        return [
            ("containment", self.round, ROUND_SECONDS),
            ("admission-guard", self.guards.refresh, REFRESH_SECONDS),
        ]

    def start(self) -> asyncio.Task[None]:
        """Read the guards' pools now, not a refresh interval after start."""
        return asyncio.get_running_loop().create_task(self.guards.refresh())

    def round_now(self) -> None:
        """Apply the rules now (a recording changed an incident), unless a round is running."""
        if self._round is None or self._round.done():
            self._round = asyncio.get_running_loop().create_task(self.round())

    async def round(self) -> None:
        """Apply the quarantine rules and put the set in the bucket where one is used; a database
        away skips a round."""
        held = self.reads.held_newest  # before the read: a change made since is no sign
        try:
            await asyncio.to_thread(self.rules.sync)
        except SQLAlchemyError as exc:
            log.warning("quarantine rules skipped: the database did not answer (%s)", type(exc).__name__)
            return
        self._say_if_older(held)
        # Not before the pools were read once: a set without guards would lift every gateway's.
        if self.bucket is not None and self.guards.refreshed:
            await self.bucket.publish(self.published(self.rules.last))

    def _say_if_older(self, held: int) -> None:
        """Say when a gateway says it holds a set of ours numbered above the database's newest
        change (once per higher revision, at most once an ``OLDER_QUIET_SECONDS``): the database is
        older than what the gateways apply, most likely restored from a backup. They keep that set,
        whose quarantines are real, until the next change, which ``rules.next_revision`` numbers
        above it and which then lifts the quarantines put after the backup."""
        revision = self.rules.last.revision
        if (
            held <= max(revision, self._said_older)
            or time.monotonic() - self._said_older_at < OLDER_QUIET_SECONDS
        ):
            return
        self._said_older, self._said_older_at = held, time.monotonic()
        log.warning("quarantine set: a gateway says it holds revision %d of the monitors' set, above the "
                    "database's newest change (%d): the database is older than the set the gateways apply "
                    "(restored from a backup?). They keep theirs until the next quarantine change, which "
                    "lifts every quarantine put after the backup until the probes find those leaks again: "
                    "put them back by hand (the gateways' logs name them)", held, revision)  # fmt: skip

    def suspect(self, item: PendingResult, incident_id: int) -> None:
        """A suspected failure was recorded on ``incident_id``: verify it by the target's proving
        probes now (``containment/verification.py``); nothing moves traffic until one proves it."""
        if self.verifier is not None:
            self.verifier.suspect(item, incident_id)

    async def confirm(self, incident_id: int, note: str) -> None:
        """An operator confirms a suspected incident: the rules act on it from this round, at once.
        Raise ``NotSuspected`` where it is not an open suspected one."""
        await asyncio.to_thread(self._word, confirm, incident_id, note)
        self.round_now()

    async def dismiss(self, incident_id: int, note: str) -> None:
        """An operator dismisses a suspected incident as benign: it resolves. Raise ``NotSuspected``."""
        await asyncio.to_thread(self._word, dismiss, incident_id, note)
        self.round_now()

    def _word(self, act: Callable[..., None], incident_id: int, note: str) -> None:
        with self.session_factory() as session, session.begin():
            act(session, incident_id=incident_id, note=note, now=datetime.now(UTC))

    async def take_up(self) -> None:
        """Take up new settings now (a policy or guard that changed, a signing key replaced), not
        at the next round; raise ``ConfigError`` where the new settings' key is not readable (the
        last key stays)."""
        signer = signer_of(self.settings())
        if signer is not None and (self.signer is None or signer.key_id != self.signer.key_id):
            log.warning("containment: the quarantine set is signed with key %s from now on", signer.key_id)
        self.signer = signer
        await self.guards.refresh()
        await self.round()

    async def document(self) -> dict[str, Any]:
        """Return the set as the gateways read it, from the rows as they are now."""
        return self.published(await asyncio.to_thread(self.rules.read))

    async def signed(
        self, gateway: str | None, held_key: str = "", held_revision: int | None = None
    ) -> bytes | None:
        """Return the set, signed, as ``GET /api/v1/quarantine`` serves it to ``gateway``, which
        holds a set signed by ``held_key`` ("": none yet) at ``held_revision``, a read counted; None
        where there is no key to sign it with. Raise :class:`GuardsUnread` while the pools were never
        read: a set without guards would lift every gateway's (a replica just started, its first
        read slow)."""
        signer = self.signer
        if signer is None:
            return None
        if not await self.guards.read_once(FIRST_READ_WAIT_SECONDS):
            raise GuardsUnread
        body = signer.sign(await self.document())
        self.reads.note(gateway, "http", held_key, held_revision)
        return body

    def report(self) -> ContainmentReport:
        """Return what ``/metrics`` exports of the containment besides the set: each target's mode,
        the reads by gateway, the foreign values found in the bucket, the signing key."""
        settings = self.settings()
        return ContainmentReport(
            modes={t.name: settings.containment_of(t).mode for t in settings.targets},
            reads=self.reads.counts(),
            last_reads=self.reads.last(),
            foreign=dict(self.bucket.foreign) if self.bucket is not None else {},
            key_id=self.signer.key_id if self.signer is not None else None,
        )

    def published(self, read: QuarantineRead) -> dict[str, Any]:
        """Return the set as ``read`` found it, at its revision, with the guards' facts."""
        now = datetime.now(UTC)
        return quarantine_set(read.quarantines, self.guards.current(), self.settings(), now, read.revision)
