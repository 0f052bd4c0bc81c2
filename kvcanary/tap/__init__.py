"""kvcanary's gateway tap: per-request summaries and keyed fingerprints for the monitor, never text.

Runs inside a gateway (LiteLLM: :mod:`kvcanary.tap.litellm`; any other Python gateway or middleware:
:class:`Tap`, its exchanges read from the request and response bodies by
:func:`kvcanary.tap.bodies.exchange_of_bodies`). What it sends is tap protocol version 4
(``docs/tap-protocol.md``), which ``taps/node`` speaks for Node gateways too. Needs nothing
beyond the standard library: no torch, no SQLAlchemy, nothing of the monitor's. Configured from the
environment by :meth:`Tap.from_env`:

- ``KVCANARY_TAP_URL``: the monitor (``http://monitor:8080``); records go to ``/api/v1/traffic``.
  Or NATS JetStream (``nats://nats:4222``, :mod:`kvcanary.tap.jetstream`, needs ``nats-py``): each
  record is published on ``kvcanary.traffic.<partition>``, kept until JetStream acknowledges it;
- ``KVCANARY_TAP_TOKEN`` or ``KVCANARY_TAP_TOKEN_FILE``: the monitor's ingest token (or API token);
  for NATS, its auth token, or the password of ``KVCANARY_TAP_NATS_USER``, and optional (a server
  without auth takes none);
- ``KVCANARY_TAP_NATS_USER`` (NATS only): the user the tap logs in as, with the token as its
  password: a server's permissions are per user (``docs/nats-permissions.conf``: a ``tap`` user may
  publish to its subjects and nothing else), which a shared token cannot give;
- ``KVCANARY_TAP_PARTITIONS`` (NATS only, default 16): the partitions records are spread over, by
  deployment; the same number as the monitor's ``traffic.jetstream.partitions``;
- ``KVCANARY_TAP_SUBJECT_PREFIX`` (NATS only, default ``kvcanary.traffic``): the monitor's
  ``traffic.jetstream.subject_prefix``;
- ``KVCANARY_TAP_KEY`` or ``KVCANARY_TAP_KEY_FILE``: the fingerprint key (16+ bytes), the same on
  every replica of the gateway, so their fingerprints meet; the monitor never needs it. Without
  one, a random key per process (overlap is then seen only within one gateway process);
- ``KVCANARY_TAP_GATEWAY``: a name for this gateway in the monitor's metrics (default: the host);
- ``KVCANARY_TAP_FLUSH_SECONDS`` (default 1): how long a record waits for others to fill its batch,
  most of the delay from a response to its verdict; shorter costs more, smaller batches;
- ``KVCANARY_TAP_PUBLIC_TEXTS``: files or folders (``:``-separated, read once at start, at most
  16 MB, ``public.py``) of texts that are public, not any customer's: licences, published
  documentation, the company's own boilerplate. A model reciting one that a single customer had
  pasted is then no leak (``public.py``); e.g. ``/usr/share/common-licenses``;
- ``KVCANARY_TAP_QUARANTINE=1``: the LiteLLM callback also keeps the deployments the monitor
  quarantined out of routing, and prompts off deployments that cannot hold them (``containment/``),
  reading the set every ``KVCANARY_TAP_QUARANTINE_POLL_SECONDS`` (default 1) from the monitor at
  ``KVCANARY_TAP_URL``, or at ``KVCANARY_TAP_QUARANTINE_URL`` with
  ``KVCANARY_TAP_QUARANTINE_TOKEN``, or, where records go to NATS, watching the monitors' KV bucket
  (``KVCANARY_TAP_QUARANTINE_BUCKET``). It takes only a set the monitors signed:
  ``KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS`` or ``KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS_FILE`` holds
  their public key(s) (required with the switch; two while keys rotate), and
  ``KVCANARY_TAP_QUARANTINE_STALE_SECONDS`` (default 300) is how long a set may go without a newer
  one before the gateway says it is stale (``docs/tap-protocol.md``, "Quarantine").
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import socket
import weakref
from pathlib import Path
from typing import Any

from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.gateway_metrics import gateway_counter
from kvcanary.tap.public import PublicPrints, files_of, public_prints, tell
from kvcanary.tap.record import Exchange, summarize
from kvcanary.tap.sender import Sender
from kvcanary.tap.transport import Transport
from kvcanary.wire import GATEWAY_PATTERN

__all__ = ["Exchange", "Tap", "TapConfigError", "summarize"]

log = logging.getLogger("kvcanary.tap")


class TapConfigError(RuntimeError):
    """The tap's environment is incomplete or wrong; the message names the variable."""


def _secret(env: str) -> str | None:
    path = os.environ.get(f"{env}_FILE", "").strip()
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise TapConfigError(f"{env}_FILE: cannot read {path}: {exc.strerror}") from None
        if not value:
            raise TapConfigError(f"{env}_FILE: {path} is empty")
        return value
    return os.environ.get(env, "").strip() or None


class Tap:
    """Observes exchanges and sends their summaries to the monitor. Thread-safe; never raises
    from :meth:`observe` (a tap must not fail a customer's request)."""

    def __init__(
        self,
        url: str,
        token: str | None,
        key: bytes,
        *,
        gateway: str = "",
        partitions: int = 16,
        subject_prefix: str = "kvcanary.traffic",
        nats_user: str | None = None,
        **sender: Any,
    ):
        """``url``: the monitor (http, https) or NATS (nats, tls); ``partitions``,
        ``subject_prefix`` and ``nats_user`` are NATS's only."""
        self._drops = gateway_counter(
            "kvcanary_tap_records_dropped",
            "Traffic records the kvcanary tap dropped: the monitor was down or slow too long, "
            "or refused them.",
        )
        timeout = sender.get("timeout_seconds", 5.0)
        transport = _transport(url, token, partitions, subject_prefix, timeout, nats_user)
        self.sender = Sender(
            url, token or "", Fingerprinter(key), gateway=gateway, on_drop=self._drops, transport=transport,
            **sender,
        )  # fmt: skip
        # A gateway restarted (SIGTERM, then a normal exit) must not lose what is still queued: the
        # tap's thread is a daemon, so it is flushed here at exit. A weak reference: registering
        # keeps no tap alive.
        atexit.register(_flush_at_exit, weakref.ref(self))

    @classmethod
    def from_env(cls, **sender: Any) -> Tap:
        """Return a tap configured from the environment (module doc); raise :class:`TapConfigError`."""
        url = os.environ.get("KVCANARY_TAP_URL", "").strip()
        if not url.startswith(("http://", "https://", *NATS_SCHEMES)):
            raise TapConfigError(
                "KVCANARY_TAP_URL: set it to the monitor's URL (http://host:port) or NATS's (nats://host:4222)"
            )
        token = _secret("KVCANARY_TAP_TOKEN")
        if token is None and not url.startswith(NATS_SCHEMES):
            raise TapConfigError(
                "KVCANARY_TAP_TOKEN: set it (or KVCANARY_TAP_TOKEN_FILE) to the ingest token"
            )
        key_text = _secret("KVCANARY_TAP_KEY")
        if key_text is None:
            log.warning(
                "kvcanary tap: KVCANARY_TAP_KEY is not set; fingerprints meet within this process only"
            )
            key = secrets.token_bytes(32)
        elif len(key_text.encode()) < 16:
            raise TapConfigError("KVCANARY_TAP_KEY: the fingerprint key needs at least 16 bytes")
        else:
            key = key_text.encode()
        gateway = gateway_env()
        partitions, prefix = _nats_env()
        user = os.environ.get("KVCANARY_TAP_NATS_USER", "").strip() or None
        sender.setdefault("flush_seconds", _flush_env())
        # Read before the tap starts: a bad path stops the gateway with nothing left running.
        public = _public_env(key)
        tap = cls(
            url, token, key, gateway=gateway, partitions=partitions, subject_prefix=prefix,
            nats_user=user, **sender,
        )  # fmt: skip
        if public is not None:
            tell(tap.sender.fingerprinter, public)
            log.info("kvcanary tap: %d public text(s) read: %d prints", public.files, len(public.prints))
        return tap

    def observe(self, exchange: Exchange) -> None:
        """Queue one exchange for summary; the work happens on the tap's thread."""
        try:
            self.sender.put(exchange)
        except Exception:  # pragma: no cover - put() only appends; a tap never fails a request
            log.exception("kvcanary tap: cannot queue an exchange")

    def stats(self) -> dict[str, int]:
        s = self.sender
        return {"sent": s.sent, "dropped": s.dropped, "rejected": s.rejected, "pending": s.pending}

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then stop; a second call does nothing."""
        self.sender.close(timeout)

    def shutdown(self) -> None:
        """The gateway is going away: send what is queued (up to ``EXIT_FLUSH_SECONDS``), stop,
        and say how many records were left unsent, if any."""
        self.close(EXIT_FLUSH_SECONDS)
        if left := self.sender.pending:
            log.error(
                "kvcanary tap: %d records not sent at exit (the monitor or NATS did not take them)", left
            )


#: How long a gateway's exit waits for the tap's last records to be acknowledged.
EXIT_FLUSH_SECONDS = 5.0


def _flush_at_exit(ref: weakref.ref[Tap]) -> None:
    tap = ref()
    if tap is not None:
        tap.shutdown()


NATS_SCHEMES = ("nats://", "tls://")


def _public_env(key: bytes) -> PublicPrints | None:
    """Return the prints of ``KVCANARY_TAP_PUBLIC_TEXTS`` under ``key`` (None: not set); raise
    :class:`TapConfigError` naming the variable and what is wrong."""
    texts = os.environ.get("KVCANARY_TAP_PUBLIC_TEXTS", "").strip()
    if not texts:
        return None
    try:
        files = files_of(Path(p) for p in texts.split(":") if p.strip())
        return public_prints((f.read_text(errors="replace") for f in files), Fingerprinter(key))
    except (OSError, ValueError) as exc:
        raise TapConfigError(f"KVCANARY_TAP_PUBLIC_TEXTS: {exc}") from None


def gateway_env() -> str:
    """Return ``KVCANARY_TAP_GATEWAY``, else the host's name made fit: the gateway's name in the
    monitor's metrics, its records and its reads of the quarantine set; raise TapConfigError."""
    gateway = os.environ.get("KVCANARY_TAP_GATEWAY", "").strip()
    if gateway and not re.fullmatch(GATEWAY_PATTERN, gateway):
        raise TapConfigError("KVCANARY_TAP_GATEWAY: up to 64 letters, digits and _.:- only")
    return gateway or re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:64]


def _nats_env() -> tuple[int, str]:
    """Return the partitions and the subject prefix from the environment; raise TapConfigError."""
    text = os.environ.get("KVCANARY_TAP_PARTITIONS", "").strip() or "16"
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise TapConfigError("KVCANARY_TAP_PARTITIONS: a whole number from 1 to 1024")
    prefix = os.environ.get("KVCANARY_TAP_SUBJECT_PREFIX", "").strip() or "kvcanary.traffic"
    if not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", prefix):
        raise TapConfigError("KVCANARY_TAP_SUBJECT_PREFIX: tokens of letters, digits, _ and - joined by dots")
    return int(text), prefix


def _flush_env() -> float:
    """Return ``KVCANARY_TAP_FLUSH_SECONDS`` (default 1): how long a record may wait for its batch."""
    text = os.environ.get("KVCANARY_TAP_FLUSH_SECONDS", "").strip() or "1"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.01 <= seconds <= 60:
        raise TapConfigError("KVCANARY_TAP_FLUSH_SECONDS: seconds from 0.01 to 60")
    return seconds


def _transport(
    url: str,
    token: str | None,
    partitions: int,
    subject_prefix: str,
    timeout_seconds: float,
    nats_user: str | None = None,
) -> Transport | None:
    """Return the JetStream sink for a NATS URL (imported only then), or None: the Sender's HTTP."""
    if not url.startswith(NATS_SCHEMES):
        return None
    if "@" in url.split("://", 1)[1].split("/", 1)[0]:
        # A URL is logged (NATS away) where a token never is.
        raise TapConfigError("KVCANARY_TAP_URL: no credentials in the URL; use KVCANARY_TAP_TOKEN(_FILE)")
    try:
        from kvcanary.tap.jetstream import JetStreamTransport
    except ImportError:
        raise TapConfigError("KVCANARY_TAP_URL: a nats:// URL needs nats-py (pip install nats-py)") from None
    return JetStreamTransport(
        url, token, partitions=partitions, subject_prefix=subject_prefix, timeout_seconds=timeout_seconds,
        user=nats_user,
    )  # fmt: skip
