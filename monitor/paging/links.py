"""The links every alert carries: to its incident page (with the signature that opens it) and to its runbook.

A person opening a page from a chat client or a phone has no bearer token, so the link is its own
credential: ``sig`` is an HMAC-SHA256 of the incident's id and opening second under the API token (a
database rebuilt under the same token reuses ids, never both). It opens that one incident's page
(``monitor/api/pages.py``), never the REST API, and rotating the token revokes every link sent. A
monitor without a token (a local-only API on loopback) sends links without ``sig``.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.storage.db import as_utc

#: 128 bits of the HMAC: unguessable, and short enough for a link in a notification.
SIGNATURE_HEX = 32


def link_signature(token: str, incident_id: int, opened_at: datetime) -> str:
    """Return the ``sig`` that opens the page of the incident ``incident_id`` opened at ``opened_at``."""
    message = f"kvcanary incident page {incident_id} {int(as_utc(opened_at).timestamp())}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()[:SIGNATURE_HEX]


def signature_ok(token: str, incident_id: int, opened_at: datetime, given: str) -> bool:
    """Return whether ``given`` is that incident's page signature (compared in constant time)."""
    return hmac.compare_digest(link_signature(token, incident_id, opened_at).encode(), given.encode())


def incident_url(base: str, incident_id: int, opened_at: datetime, token: str | None) -> str:
    """Return the link to an incident's page, signed when the API has a token."""
    page = f"{base}/incidents/{incident_id}"
    return f"{page}?sig={link_signature(token, incident_id, opened_at)}" if token else page


def runbook_base(settings: Settings) -> str:
    """Return where the runbooks are: ``alerting.runbook_base_url``, else the monitor's own."""
    return settings.alerting.runbook_base_url or f"{settings.api.base_url}/runbooks"
