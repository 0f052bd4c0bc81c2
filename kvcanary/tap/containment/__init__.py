"""Containment in the gateway: the one room of the tap where kvcanary's decisions are applied.

- ``document.py``: the quarantine set the monitor publishes, parsed whole or refused whole;
- ``signed.py``: only a set the monitors signed, newer than the one held, is taken;
- ``watch.py``: the set read from the monitor over HTTP (``GET /api/v1/quarantine``), kept in
  memory by a thread of its own; ``bucket.py``: the same set watched in the monitors' JetStream KV
  bucket, for taps whose records go to NATS;
- ``litellm_filter.py``: quarantined deployments kept out of a LiteLLM router's choice;
- ``guard.py``: the admission guard, a prompt kept off a deployment whose KV pool surely cannot
  hold it; both read deployments through ``deployments.py``.

:func:`watch_from_env` is how a gateway turns it on (``docs/tap-protocol.md``, "Quarantine").
Standard library only, but for ``signed.py`` (``cryptography``'s Ed25519, which LiteLLM installs)
and ``bucket.py`` (nats-py, imported where records go to NATS).
"""

from __future__ import annotations

import os
import re
from typing import Any

from kvcanary.tap import TapConfigError, _secret, gateway_env
from kvcanary.tap.containment.signed import PublicKeys, parse_public_keys
from kvcanary.tap.containment.watch import QuarantineWatch
from kvcanary.wire import QUARANTINE_BUCKET

__all__ = ["QuarantineWatch", "watch_from_env"]


def watch_from_env() -> QuarantineWatch | None:
    """Return a started watch when ``KVCANARY_TAP_QUARANTINE`` is on, else None; raise
    :class:`TapConfigError` naming a wrong variable (``docs/tap-protocol.md``, "Quarantine").

    The monitor is ``KVCANARY_TAP_QUARANTINE_URL``, else ``KVCANARY_TAP_URL`` when that is the
    monitor's (http, https); the token ``KVCANARY_TAP_QUARANTINE_TOKEN(_FILE)``, else the tap's.
    Where the tap's records go to NATS and no quarantine URL is set, the set is watched in the
    monitors' KV bucket (``KVCANARY_TAP_QUARANTINE_BUCKET``, ``kvcanary/tap/containment/bucket.py``)
    with the tap's own NATS credentials. Either way only a set signed by a key of
    ``KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS(_FILE)`` is taken."""
    switch = os.environ.get("KVCANARY_TAP_QUARANTINE", "").strip().lower()
    if switch in ("", "0", "false", "off", "no"):
        return None
    if switch not in ("1", "true", "on", "yes"):
        raise TapConfigError(
            "KVCANARY_TAP_QUARANTINE: 1 to keep quarantined deployments out of routing, or 0"
        )
    seen: dict[str, Any] = {  # what both kinds of watch take
        "keys": _public_keys_env(),
        "gateway": gateway_env(),
        "poll_seconds": _seconds_env("KVCANARY_TAP_QUARANTINE_POLL_SECONDS", 1.0, 0.1, 60),
        "stale_seconds": _seconds_env("KVCANARY_TAP_QUARANTINE_STALE_SECONDS", 300.0, 1, 7 * 86400),
    }
    tap_url = os.environ.get("KVCANARY_TAP_URL", "").strip()
    own_url = os.environ.get("KVCANARY_TAP_QUARANTINE_URL", "").strip()
    url = own_url or tap_url
    if not own_url and tap_url.startswith(("nats://", "tls://")):
        return _bucket_watch(tap_url, seen)
    if not url.startswith(("http://", "https://")):
        raise TapConfigError(
            "KVCANARY_TAP_QUARANTINE_URL: set it to the monitor's URL (http://host:port) where "
            "KVCANARY_TAP_URL is not the monitor's"
        )
    token = _secret("KVCANARY_TAP_QUARANTINE_TOKEN")
    if token is None and (own_url in ("", tap_url)):
        token = _secret("KVCANARY_TAP_TOKEN")
    if token is None:
        raise TapConfigError(
            "KVCANARY_TAP_QUARANTINE_TOKEN: set it (or KVCANARY_TAP_QUARANTINE_TOKEN_FILE) to the "
            "monitor's ingest token"
        )
    return QuarantineWatch(url, token, **seen)


def _bucket_watch(servers: str, seen: dict[str, Any]) -> QuarantineWatch:
    from kvcanary.tap.containment.bucket import BucketWatch  # nats-py: only where records go to NATS

    bucket = os.environ.get("KVCANARY_TAP_QUARANTINE_BUCKET", "").strip() or QUARANTINE_BUCKET
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", bucket):
        raise TapConfigError("KVCANARY_TAP_QUARANTINE_BUCKET: a bucket name (letters, digits, _ and -)")
    user = os.environ.get("KVCANARY_TAP_NATS_USER", "").strip() or None
    token = _secret("KVCANARY_TAP_TOKEN")
    return BucketWatch(servers, token, user=user, bucket=bucket, **seen)


def _public_keys_env() -> PublicKeys:
    """Return the monitors' public keys of ``KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS(_FILE)``; raise
    TapConfigError: a tap that quarantines takes only a set they signed, so it needs them."""
    name = "KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS"
    text = _secret(name)
    if text is None:
        raise TapConfigError(
            f"{name}: set it (or {name}_FILE) to the monitors' public key(s), what `kvcanary "
            "containment keygen` writes to quarantine-signing.pub: the tap takes only a set they signed"
        )
    where = f"{name}_FILE" if os.environ.get(f"{name}_FILE", "").strip() else name
    try:
        return parse_public_keys(text)
    except ImportError:
        raise TapConfigError(
            "KVCANARY_TAP_QUARANTINE: checking the set's signature needs cryptography "
            "(pip install cryptography; LiteLLM's proxy has it)"
        ) from None
    except ValueError as exc:
        raise TapConfigError(f"{where}: {exc}") from None


def _seconds_env(name: str, default: float, low: float, high: float) -> float:
    """Return the seconds ``name`` holds (``default`` unset), from ``low`` to ``high``; raise
    TapConfigError naming it."""
    text = os.environ.get(name, "").strip()
    try:
        seconds = float(text) if text else default
    except ValueError:
        seconds = -1.0
    if not low <= seconds <= high:
        raise TapConfigError(f"{name}: seconds from {low:g} to {high:g}")
    return seconds
