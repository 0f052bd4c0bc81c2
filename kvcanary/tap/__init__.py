"""kvcanary's gateway tap: per-request summaries and keyed fingerprints for the monitor, never text.

Runs inside a gateway (LiteLLM: :mod:`kvcanary.tap.litellm`; any other Python gateway or middleware:
:class:`Tap`). Needs nothing beyond the standard library: no torch, no SQLAlchemy, nothing of the
monitor's. Configured from the environment by :meth:`Tap.from_env`:

- ``KVCANARY_TAP_URL``: the monitor (``http://monitor:8080``); records go to ``/api/v1/traffic``;
- ``KVCANARY_TAP_TOKEN`` or ``KVCANARY_TAP_TOKEN_FILE``: the monitor's ingest token (or API token);
- ``KVCANARY_TAP_KEY`` or ``KVCANARY_TAP_KEY_FILE``: the fingerprint key (16+ bytes), the same on
  every replica of the gateway, so their fingerprints meet; the monitor never needs it. Without
  one, a random key per process (overlap is then seen only within one gateway process);
- ``KVCANARY_TAP_GATEWAY``: a name for this gateway in the monitor's metrics (default: the host).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from pathlib import Path
from typing import Any

from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize
from kvcanary.tap.sender import Sender

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

    def __init__(self, url: str, token: str, key: bytes, *, gateway: str = "", **sender: Any):
        self._drops = _drop_counter()
        self.sender = Sender(url, token, Fingerprinter(key), gateway=gateway, on_drop=self._drops, **sender)

    @classmethod
    def from_env(cls, **sender: Any) -> Tap:
        """Return a tap configured from the environment (module doc); raise :class:`TapConfigError`."""
        url = os.environ.get("KVCANARY_TAP_URL", "").strip()
        if not url.startswith(("http://", "https://")):
            raise TapConfigError("KVCANARY_TAP_URL: set it to the monitor's URL (http://host:port)")
        token = _secret("KVCANARY_TAP_TOKEN")
        if token is None:
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
        gateway = os.environ.get("KVCANARY_TAP_GATEWAY", "").strip()
        if gateway and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", gateway):
            raise TapConfigError("KVCANARY_TAP_GATEWAY: up to 64 letters, digits and _.:- only")
        host = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:64]
        return cls(url, token, key, gateway=gateway or host, **sender)

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
        self.sender.close(timeout)


def _drop_counter() -> Any:
    """Return a callable counting dropped records in the gateway's own metrics (prometheus-client,
    where the gateway has it: LiteLLM does), or a no-op."""
    try:
        from prometheus_client import REGISTRY, Counter
    except ImportError:
        return lambda n: None
    name = "kvcanary_tap_records_dropped"
    existing = REGISTRY._names_to_collectors.get(f"{name}_total")  # one counter per process
    counter: Any = existing or Counter(
        name,
        "Traffic records the kvcanary tap dropped: the monitor was down or slow too long, or refused them.",
    )
    return lambda n: counter.inc(n)
