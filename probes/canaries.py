"""Canary markers: unguessable secrets planted as one tenant and looked for in every response.

A marker reads ``KVC-<id>-<secret>``: ``id`` is 32 public bits that name it in evidence, ``secret``
is 128 bits from :mod:`secrets`. The book keeps only a SHA-256 of each live marker with its owner
and expiry, so the monitor never holds a copy of what it planted once the probe is done, and a
leak is recognised by hashing what a response contains. A foreign marker in a response cannot be
benign: the chance that a model emits 128 given random bits is 2**-128.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MARKER_RE = re.compile(r"KVC-([0-9a-f]{8})-([0-9a-f]{32})")
# Partial markers (a page boundary can cut one) are redacted too: keep the id, hide the rest.
_PARTIAL_RE = re.compile(r"(KVC-[0-9a-f]{8})-[0-9a-f]+|(?<![0-9a-f])[0-9a-f]{24,}")
REDACTED = "-<redacted>"


def new_marker() -> tuple[str, str]:
    """Return ``(marker_id, marker)`` with a fresh 128-bit secret."""
    marker_id = secrets.token_hex(4)
    return marker_id, f"KVC-{marker_id}-{secrets.token_hex(16)}"


def marker_hash(marker: str) -> str:
    return hashlib.sha256(marker.encode()).hexdigest()


def redact_markers(text: str) -> str:
    """Return ``text`` with every marker secret (whole or cut) replaced, ids kept."""
    return _PARTIAL_RE.sub(lambda m: (m.group(1) + REDACTED) if m.group(1) else "<redacted>", text)


@dataclass(frozen=True)
class LiveMarker:
    marker_id: str
    digest: str
    target: str
    tenant: str
    expires_at: float


@dataclass(frozen=True)
class LeakHit:
    """A live marker of one (target, tenant) found in a response to another."""

    marker_id: str
    digest: str
    owner_target: str
    owner_tenant: str
    reader_target: str
    reader_tenant: str
    excerpt: str

    def as_evidence(self) -> dict[str, str]:
        return {
            "marker_id": self.marker_id,
            "marker_sha256": self.digest,
            "owner_tenant": self.owner_tenant,
            "owner_target": self.owner_target,
            "reader_tenant": self.reader_tenant,
            "excerpt": self.excerpt,
        }


class MarkerBook:
    """Live markers by hash, with expiry. Safe to share between concurrent probes."""

    def __init__(
        self,
        ttl_seconds: float = 6 * 3600,
        max_markers: int = 200_000,
        clock: Callable[[], float] = time.time,
    ):
        self.ttl_seconds = ttl_seconds
        self.max_markers = max_markers
        self._clock = clock
        self._live: dict[str, LiveMarker] = {}
        self._lock = threading.Lock()

    def plant(self, target: str, tenant: str) -> tuple[str, str]:
        """Create a marker owned by (target, tenant); return ``(marker_id, marker)``.

        The caller puts the marker in a prompt and forgets it; the book keeps only its hash.
        """
        marker_id, marker = new_marker()
        now = self._clock()
        live = LiveMarker(marker_id, marker_hash(marker), target, tenant, now + self.ttl_seconds)
        with self._lock:
            if len(self._live) >= self.max_markers:
                self._expire(now, force=True)
            self._live[live.digest] = live
        return marker_id, marker

    def scan(self, text: str, *, target: str, reader: str) -> list[LeakHit]:
        """Return the live markers in ``text`` that belong to anyone but (target, reader)."""
        if not text or "KVC-" not in text:
            return []
        now = self._clock()
        hits: list[LeakHit] = []
        for match in MARKER_RE.finditer(text):
            digest = marker_hash(match.group(0))
            with self._lock:
                live = self._live.get(digest)
            if live is None or live.expires_at < now:
                continue
            if (live.target, live.tenant) == (target, reader):
                continue
            start = max(0, match.start() - 48)
            excerpt = redact_markers(text[start : match.end() + 48])
            hits.append(LeakHit(live.marker_id, digest, live.target, live.tenant, target, reader, excerpt))
        return hits

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._live)

    def _expire(self, now: float, force: bool = False) -> None:
        # Called with the lock held. When full, drop the oldest tenth so planting never fails.
        for digest in [d for d, m in self._live.items() if m.expires_at < now]:
            del self._live[digest]
        if force and len(self._live) >= self.max_markers:
            oldest = sorted(self._live.values(), key=lambda m: m.expires_at)[: self.max_markers // 10 or 1]
            for marker in oldest:
                del self._live[marker.digest]
