"""Canary markers: unguessable secrets planted as one tenant and looked for in every response.

A marker reads ``KVC-<id>-<secret>``: ``id`` is 32 random public bits that name it in evidence, and
``secret`` is 128 bits that only this monitor's key can produce. The secret *seals* who planted the
marker and when: 64 bits hold the owner's tag and the planting minute, encrypted with a pad drawn
from the key and the id, and 64 bits are a MAC over the id and that payload.

So the book stores nothing per marker. A response is judged by opening every marker-shaped string
in it: a valid MAC proves the monitor planted it (a model emits a valid one by chance with
probability 2**-64), the payload says whose it is and how old. Memory stays constant however many
targets, tenants and hours of markers are live, and no marker is ever forgotten early: there is no
cap to evict from. Markers die of age only (``ttl_seconds``), to the minute.

Monitor replicas recognise each other's markers when they share the key (``MarkerBook(key=...)``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

# Case-insensitive: a model (or a gateway) that upper-cases what it copies still hands the marker on.
MARKER_RE = re.compile(r"KVC-([0-9a-f]{8})-([0-9a-f]{32})", re.IGNORECASE)
# Partial markers (a page boundary can cut one) are redacted too: keep the id, hide the rest.
_PARTIAL_RE = re.compile(r"(KVC-[0-9a-f]{8})-[0-9a-f]+|(?<![0-9a-f])[0-9a-f]{24,}", re.IGNORECASE)
# Key-like strings another tenant's text may carry: API keys, bearer tokens, long opaque secrets.
_KEY_RE = re.compile(
    r"\b(?:sk|pk|rk|api|key|token|secret)[-_][A-Za-z0-9_\-]{8,}|\bbearer\s+[A-Za-z0-9_.~+/=\-]{8,}"
    r"|(?<![A-Za-z0-9_\-])[A-Za-z0-9_\-]{32,}(?![A-Za-z0-9_\-])",
    re.IGNORECASE,
)
REDACTED = "-<redacted>"

# Minutes are counted from 2026-01-01 UTC in 24 bits: the count wraps after 31 years, and ages are
# taken modulo the wrap, so only a marker older than that could pass for a young one.
_EPOCH = 1767225600
_MINUTE_BITS = 24
#: Minutes a marker may seem to come from the future and still be live: replicas' clocks differ.
_SKEW_MINUTES = 5
_OWNER_BYTES = 5  # 40-bit owner tags: among 10,000 (target, tenant) pairs, a clash has odds ~5e-5
UNKNOWN_OWNER = "(unknown)"


def marker_hash(marker: str) -> str:
    return hashlib.sha256(marker.encode()).hexdigest()


def redact_markers(text: str) -> str:
    """Return ``text`` with every marker secret (whole or cut, any case) and every key-like string
    replaced; marker ids are kept, since evidence names markers by them."""
    text = _PARTIAL_RE.sub(lambda m: (m.group(1) + REDACTED) if m.group(1) else "<redacted>", text)
    return _KEY_RE.sub("<redacted>", text)


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
    """Plants sealed markers and recognises live ones in text. Safe to share between probes.

    ``key`` (32 random bytes by default) seals every marker; ``ttl_seconds`` is how long a planted
    marker stays live. The only state is the table of owner tags to names, one entry per
    (target, tenant) ever planted as or :meth:`register`-ed.
    """

    def __init__(
        self,
        ttl_seconds: float = 6 * 3600,
        *,
        key: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.ttl_seconds = ttl_seconds
        self._key = key if key is not None else secrets.token_bytes(32)
        if len(self._key) < 16:
            raise ValueError("a marker key needs at least 16 bytes")
        self._clock = clock
        self._owners: dict[bytes, tuple[str, str]] = {}
        self._tags: dict[tuple[str, str], bytes] = {}  # (target, tenant) -> owner tag; as many as configured

    def register(self, target: str, tenant: str) -> None:
        """Name (target, tenant) in advance, so a marker it planted elsewhere (another replica with
        the same key, or before a restart) is reported with its owner's name."""
        self._owners[self._owner_tag(target, tenant)] = (target, tenant)

    def plant(self, target: str, tenant: str) -> tuple[str, str]:
        """Create a marker owned by (target, tenant); return ``(marker_id, marker)``.

        The caller puts the marker in a prompt and forgets it; the book keeps nothing of it.
        """
        tag = self._owner_tag(target, tenant)
        self._owners[tag] = (target, tenant)
        marker_id = secrets.token_bytes(4)
        minute = self._minute(self._clock())
        payload = tag + minute.to_bytes(_MINUTE_BITS // 8, "big")
        sealed = _xor(payload, self._pad(marker_id)) + self._mac(marker_id, payload)
        return marker_id.hex(), f"KVC-{marker_id.hex()}-{sealed.hex()}"

    def scan(self, text: str, *, target: str, reader: str) -> list[LeakHit]:
        """Return the live markers in ``text`` that belong to anyone but (target, reader)."""
        if not text or ("KVC-" not in text and "kvc-" not in text.lower()):
            return []
        reader_tag = self._owner_tag(target, reader)
        now_minute = self._minute(self._clock())
        hits: list[LeakHit] = []
        for match in MARKER_RE.finditer(text):
            tag = self._open(match.group(1).lower(), match.group(2).lower(), now_minute)
            if tag is None or tag == reader_tag:
                continue
            owner_target, owner_tenant = self._owners.get(tag, (UNKNOWN_OWNER, UNKNOWN_OWNER))
            start = max(0, match.start() - 48)
            excerpt = redact_markers(text[start : match.end() + 48])
            hits.append(
                LeakHit(
                    match.group(1).lower(),
                    marker_hash("KVC-" + match.group(0)[4:].lower()),  # one digest whatever the case
                    owner_target,
                    owner_tenant,
                    target,
                    reader,
                    excerpt,
                )
            )
        return hits

    def is_live(self, marker: str) -> bool:
        """Return True when ``marker`` is a whole marker of this book that has not expired."""
        match = MARKER_RE.fullmatch(marker)
        if match is None:
            return False
        return self._open(match.group(1), match.group(2), self._minute(self._clock())) is not None

    # --- sealing -----------------------------------------------------------------------------------

    def _open(self, id_hex: str, secret_hex: str, now_minute: int) -> bytes | None:
        """Return the owner tag of a live marker, or None (not ours, forged, or expired)."""
        marker_id, sealed = bytes.fromhex(id_hex), bytes.fromhex(secret_hex)
        payload = _xor(sealed[:8], self._pad(marker_id))
        if not hmac.compare_digest(sealed[8:], self._mac(marker_id, payload)):
            return None
        planted = int.from_bytes(payload[_OWNER_BYTES:], "big")
        age_minutes = (now_minute - planted) % (1 << _MINUTE_BITS)
        if age_minutes >= (1 << _MINUTE_BITS) - _SKEW_MINUTES:
            age_minutes = 0  # planted "in the future": a replica whose clock runs ahead of ours
        # The minute a marker was planted in counts as age 0: allow one minute of rounding.
        if age_minutes * 60 > self.ttl_seconds + 60:
            return None
        return payload[:_OWNER_BYTES]

    def _owner_tag(self, target: str, tenant: str) -> bytes:
        tag = self._tags.get((target, tenant))
        if tag is None:  # one HMAC per owner, not one per marker planted or read
            tag = self._digest(b"owner", target.encode(), tenant.encode())[:_OWNER_BYTES]
            self._tags[(target, tenant)] = tag
        return tag

    def _pad(self, marker_id: bytes) -> bytes:
        return self._digest(b"pad", marker_id)[:8]

    def _mac(self, marker_id: bytes, payload: bytes) -> bytes:
        return self._digest(b"mac", marker_id, payload)[:8]

    def _digest(self, *parts: bytes) -> bytes:
        # Length-prefixed parts: ("ab", "c") and ("a", "bc") must not seal alike.
        message = b"".join(len(p).to_bytes(2, "big") + p for p in parts)
        return hmac.new(self._key, message, hashlib.sha256).digest()

    @staticmethod
    def _minute(now: float) -> int:
        return int((now - _EPOCH) // 60) % (1 << _MINUTE_BITS)


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))
