"""The link every alert carries to its incident page, and the signature that opens it.

A person opening a page from a chat client or a phone has no bearer token, so the link is its own
credential: ``sig`` is an HMAC-SHA256 of the incident id under the API token. It opens that one
incident's page (``monitor/api/pages.py``), never the REST API, and rotating the token revokes every
link sent. A monitor without a token (a local-only API on loopback) sends links without ``sig``.
"""

from __future__ import annotations

import hashlib
import hmac

#: 128 bits of the HMAC: unguessable, and short enough for a link in a notification.
SIGNATURE_HEX = 32


def link_signature(token: str, incident_id: int) -> str:
    """Return the ``sig`` that opens incident ``incident_id``'s page under API token ``token``."""
    message = f"kvcanary incident page {incident_id}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()[:SIGNATURE_HEX]


def signature_ok(token: str, incident_id: int, given: str) -> bool:
    """Return whether ``given`` is the signature of ``incident_id``'s page (compared in constant time)."""
    return hmac.compare_digest(link_signature(token, incident_id).encode(), given.encode())


def incident_url(base: str, incident_id: int, token: str | None) -> str:
    """Return the link to incident ``incident_id``'s page, signed when the API has a token."""
    page = f"{base}/incidents/{incident_id}"
    return f"{page}?sig={link_signature(token, incident_id)}" if token else page
