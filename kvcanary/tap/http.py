"""The tap's HTTP transport: a batch posted to the monitor's ``/api/v1/traffic``, with the ingest
token, redirects not followed (a token must not travel to another host) and no proxy from the
environment. What each answer means to the batch (taken, some records refused, refused whole, or
to be sent again) is ``docs/tap-protocol.md``'s, and so are the body's bytes (``kvcanary.wire``:
the protocol's version, the records written as the wire writes them).

A body the monitor refuses as too large (413: its cap, or a proxy's in front of it) is split in
halves, each posted as a batch of its own (an id of its own, made from the batch's by
``kvcanary.wire.part_id``, so that a retry splits and names them alike; the drop report riding with
the first half), down to single records: a record that alone is refused as too large can never be
taken, and is dropped and counted as refused. The size refused is remembered: a later body as
large is split before it is posted, not sent to be refused again.
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.request
from typing import Any

from kvcanary.tap.transport import Batch
from kvcanary.wire import batch_body, encode, part_id

log = logging.getLogger("kvcanary.tap")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a misconfigured URL: following it would turn the POST into a GET (urllib does)
    and carry the token to wherever it points."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect, urllib.request.ProxyHandler({}))


class _TooLarge(Exception):
    """The monitor refused a body as too large (413)."""


class HttpTransport:
    """Posts a batch to the monitor's ``/api/v1/traffic``: taken whole (some records perhaps refused
    with 422) or not at all, in parts where the monitor refuses it as too large (the module doc)."""

    def __init__(self, url: str, token: str, timeout_seconds: float = 5.0):
        self.url = url.rstrip("/") + "/api/v1/traffic"
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.timeout_seconds = timeout_seconds
        #: The batch's records as JSON: a retry does not serialize them again.
        self._encoded: tuple[str, list[bytes]] = ("", [])
        #: The smallest body the monitor refused as too large (None: none was).
        self.too_large: int | None = None

    def send(self, batch: Batch) -> tuple[int, int]:
        if self._encoded[0] != batch.id:
            self._encoded = (batch.id, [encode(record) for record in batch.records])
        taken, refused = self._send_part(
            batch, self._encoded[1], 0, len(batch.records), batch.id, batch.dropped
        )
        if taken == len(batch.records):
            self._encoded = ("", [])
        return taken, refused

    def _send_part(
        self, batch: Batch, encoded: list[bytes], start: int, end: int, part: str, dropped: int
    ) -> tuple[int, int]:
        """Post records ``start`` to ``end`` of ``batch`` as the batch ``part`` reporting ``dropped``,
        in halves where too large; return how many were taken from ``start`` on (the rest wait) and
        how many of those were refused for ever."""
        body = batch_body(part, batch.gateway, dropped, encoded[start:end])
        try:
            if end - start > 1 and self.too_large is not None and len(body) >= self.too_large:
                raise _TooLarge
            return self._post(body, end - start)
        except _TooLarge:
            pass
        if end - start == 1:  # never to be taken: dropped, and counted as refused
            log.error("kvcanary tap: the monitor refused a record of %d bytes as too large (413); dropped",
                      len(body))  # fmt: skip
            return 1, 1
        middle = (start + end) // 2
        first = self._send_part(batch, encoded, start, middle, part_id(part, 0), dropped)
        if first[0] < middle - start:  # the first half waits: so does the second, behind it
            return first
        second = self._send_part(batch, encoded, middle, end, part_id(part, 1), 0)
        return first[0] + second[0], first[1] + second[1]

    def _post(self, body: bytes, records: int) -> tuple[int, int]:
        """Return (how many of the body's ``records`` the monitor took: all or none, how many of
        those it refused); raise :class:`_TooLarge` for a 413."""
        request = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        try:
            with _OPENER.open(request, timeout=self.timeout_seconds) as answer:
                answer.read()
            return records, 0
        except urllib.error.HTTPError as exc:
            if exc.code == 422:  # some records refused, the rest judged: the answer says how many
                try:
                    refused = int(json.loads(exc.read())["rejected"])
                except (ValueError, KeyError, TypeError, OSError):
                    refused = records
                log.error("kvcanary tap: the monitor refused %d record(s) of a batch (422)", refused)
                return records, min(max(refused, 0), records)
            if exc.code == 413:
                if self.too_large is None or len(body) < self.too_large:
                    log.warning("kvcanary tap: the monitor refused a body of %d bytes as too large (413); "
                                "bodies as large are split", len(body))  # fmt: skip
                    self.too_large = len(body)
                raise _TooLarge from None
            if exc.code == 400:  # refused whole, and would be forever
                log.error("kvcanary tap: the monitor refused a batch (400): %d records dropped", records)
                return records, records
            log.warning("kvcanary tap: the monitor answered %s; records wait", exc.code)
            return 0, 0
        except (OSError, http.client.HTTPException) as exc:
            log.warning("kvcanary tap: cannot reach the monitor (%s); records wait", exc)
            return 0, 0

    def close(self) -> None:
        """Nothing is held between posts."""

    def after_fork_in_child(self) -> None:
        """Forget the parent's encoded batch: the child sends batches of its own."""
        self._encoded = ("", [])
