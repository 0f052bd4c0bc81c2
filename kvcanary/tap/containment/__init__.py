"""Containment in the gateway: the one room of the tap where kvcanary's decisions are applied.

- ``document.py``: the quarantine set the monitor publishes, parsed whole or refused whole;
- ``watch.py``: the set read from the monitor over HTTP (``GET /api/v1/quarantine``), kept in
  memory by a thread of its own; ``bucket.py``: the same set watched in the monitors' JetStream KV
  bucket, for taps whose records go to NATS;
- ``litellm_filter.py``: quarantined deployments kept out of a LiteLLM router's choice;
- ``guard.py``: the admission guard, a prompt kept off a deployment whose KV pool surely cannot
  hold it; both read deployments through ``deployments.py``.

:func:`watch_from_env` is how a gateway turns it on (``docs/tap-protocol.md``, "Quarantine").
Standard library only, but for ``bucket.py`` (nats-py, imported where records go to NATS).
"""

from __future__ import annotations

import os
import re

from kvcanary.tap import TapConfigError, _secret
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
    with the tap's own NATS credentials."""
    switch = os.environ.get("KVCANARY_TAP_QUARANTINE", "").strip().lower()
    if switch in ("", "0", "false", "off", "no"):
        return None
    if switch not in ("1", "true", "on", "yes"):
        raise TapConfigError(
            "KVCANARY_TAP_QUARANTINE: 1 to keep quarantined deployments out of routing, or 0"
        )
    tap_url = os.environ.get("KVCANARY_TAP_URL", "").strip()
    own_url = os.environ.get("KVCANARY_TAP_QUARANTINE_URL", "").strip()
    url = own_url or tap_url
    if not own_url and tap_url.startswith(("nats://", "tls://")):
        return _bucket_watch(tap_url)
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
    return QuarantineWatch(url, token, poll_seconds=_poll_env())


def _bucket_watch(servers: str) -> QuarantineWatch:
    from kvcanary.tap.containment.bucket import BucketWatch  # nats-py: only where records go to NATS

    bucket = os.environ.get("KVCANARY_TAP_QUARANTINE_BUCKET", "").strip() or QUARANTINE_BUCKET
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", bucket):
        raise TapConfigError("KVCANARY_TAP_QUARANTINE_BUCKET: a bucket name (letters, digits, _ and -)")
    user = os.environ.get("KVCANARY_TAP_NATS_USER", "").strip() or None
    token = _secret("KVCANARY_TAP_TOKEN")
    return BucketWatch(servers, token, user=user, bucket=bucket, poll_seconds=_poll_env())


def _poll_env() -> float:
    """Return ``KVCANARY_TAP_QUARANTINE_POLL_SECONDS`` (default 1): how often the set is read."""
    text = os.environ.get("KVCANARY_TAP_QUARANTINE_POLL_SECONDS", "").strip() or "1"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.1 <= seconds <= 60:
        raise TapConfigError("KVCANARY_TAP_QUARANTINE_POLL_SECONDS: seconds from 0.1 to 60")
    return seconds
