"""The tap's HTTP transport: a batch posted to the monitor's ``/api/v1/traffic``, with the ingest
token, redirects not followed (a token must not travel to another host) and no proxy from the
environment. What each answer means to the batch (taken, some records refused, refused whole, or
to be sent again) is ``docs/tap-protocol.md``'s.
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcanary.tap.sender import Batch

log = logging.getLogger("kvcanary.tap")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a misconfigured URL: following it would turn the POST into a GET (urllib does)
    and carry the token to wherever it points."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect, urllib.request.ProxyHandler({}))


class HttpTransport:
    """Posts a batch to the monitor's ``/api/v1/traffic``: taken whole (some records perhaps refused
    with 422) or not at all."""

    def __init__(self, url: str, token: str, timeout_seconds: float = 5.0):
        self.url = url.rstrip("/") + "/api/v1/traffic"
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.timeout_seconds = timeout_seconds
        self._encoded: tuple[str, bytes] = ("", b"")  # a retry does not serialize the batch again

    def send(self, batch: Batch) -> tuple[int, int]:
        if self._encoded[0] != batch.id:
            body = {"batch": batch.id, "gateway": batch.gateway, "dropped": batch.dropped,
                    "records": batch.records}  # fmt: skip
            self._encoded = (batch.id, json.dumps(body).encode())
        taken, refused = self._post(self._encoded[1], len(batch.records))
        if taken:
            self._encoded = ("", b"")
        return (len(batch.records) if taken else 0), refused

    def _post(self, body: bytes, records: int) -> tuple[bool, int]:
        """Return (whether the monitor took the batch, how many of its records it refused)."""
        request = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        try:
            with _OPENER.open(request, timeout=self.timeout_seconds) as answer:
                answer.read()
            return True, 0
        except urllib.error.HTTPError as exc:
            if exc.code == 422:  # some records refused, the rest judged: the answer says how many
                try:
                    refused = int(json.loads(exc.read())["rejected"])
                except (ValueError, KeyError, TypeError, OSError):
                    refused = records
                log.error("kvcanary tap: the monitor refused %d record(s) of a batch (422)", refused)
                return True, min(max(refused, 0), records)
            if exc.code in (400, 413):  # refused whole, and would be forever
                log.error(
                    "kvcanary tap: the monitor refused a batch (%s): %d records dropped", exc.code, records
                )
                return True, records
            log.warning("kvcanary tap: the monitor answered %s; records wait", exc.code)
            return False, 0
        except (OSError, http.client.HTTPException) as exc:
            log.warning("kvcanary tap: cannot reach the monitor (%s); records wait", exc)
            return False, 0

    def close(self) -> None:
        """Nothing is held between posts."""

    def after_fork_in_child(self) -> None:
        """Forget the parent's encoded batch: the child sends batches of its own."""
        self._encoded = ("", b"")
