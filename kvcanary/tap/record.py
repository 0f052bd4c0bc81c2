"""One exchange seen by a gateway, and the summary of it the monitor receives.

:class:`Exchange` is what a gateway knows about one request once its response is sent: who asked,
which deployment answered, how, and the texts. :meth:`Exchange.bounded` cuts the texts to what the
fingerprints read (head and tail) once their sizes are taken, so a queued exchange holds at most
``MAX_TEXT_CHARS`` of each text however long the prompt was. :func:`summarize` turns it into the
record posted to ``/api/v1/traffic``: sizes, usage, timings, the marker-shaped strings of the
response (the monitor checks their seals) and keyed fingerprints. Every field is made to fit the
monitor's bounds here, so no customer's input can get a batch refused. The texts go no further.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvcanary.tap.fingerprints import MAX_FINGERPRINTS, OWN, Fingerprinter, cut

#: The shape of a kvcanary marker (``probes/markers.py``: ``KVC-<8 hex id>-<32 hex secret>``), any
#: case. The monitor opens each one; a string of this shape it did not seal is nobody's marker.
MARKER_RE = re.compile(r"KVC-[0-9a-f]{8}-[0-9a-f]{32}", re.IGNORECASE)
MAX_MARKERS = 32
#: Bounds of the strings a record names (ids, callers, deployments); longer ones are cut.
MAX_NAME_CHARS = 200
CALLER_KINDS = ("team", "key_alias", "key_hash", "end_user", "unknown")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass
class Exchange:
    """One request and its response as the gateway saw them. Times are epoch seconds."""

    request_id: str
    started: float
    caller: str
    caller_kind: str  # team | key_alias | key_hash | end_user | unknown
    api_base: str
    model: str = ""
    model_group: str = ""
    key_hash: str = ""
    stream: bool = False
    status: int = 200
    finish_reason: str | None = None
    latency_seconds: float | None = None
    ttft_seconds: float | None = None
    prompt: str = ""
    messages: int = 0
    response: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    #: The prompt's full size, when the texts were cut (:meth:`bounded`); None: ``prompt`` is whole.
    prompt_chars: int | None = None
    prompt_bytes: int | None = None
    response_chars: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def bounded(self) -> Exchange:
        """Return this exchange with its sizes taken and its texts cut to what is fingerprinted."""
        if self.prompt_chars is not None:
            return self
        prompt_bytes = (
            len(self.prompt) if self.prompt.isascii() else len(self.prompt.encode("utf-8", "surrogatepass"))
        )
        return dataclasses.replace(
            self, prompt=cut(self.prompt), response=cut(self.response), prompt_chars=len(self.prompt),
            prompt_bytes=prompt_bytes, response_chars=len(self.response),
        )  # fmt: skip


def _name(value: object) -> str:
    """A name fit for the record: plain (no control characters), at most ``MAX_NAME_CHARS``, and
    valid UTF-8 (a lone surrogate, written as JSON, gets the whole batch refused unparsed)."""
    name = _CONTROL_RE.sub("", str(value or ""))[:MAX_NAME_CHARS]
    return name if name.isascii() else name.encode("utf-8", "replace").decode()


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 10**12 else None


def _seconds(value: object) -> float | None:
    """A duration, or None when it is not one (a wall clock stepped back between two readings)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if 0 <= value <= 7 * 86_400 else None


def _epoch(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return float(value) if 0 <= value <= 2**33 else 0.0


def key_digest(value: str, key: bytes) -> str:
    """Return a SHA-256 hex digest of a caller's key as the record may carry it.

    LiteLLM reports ``user_api_key_hash`` as the key's SHA-256 for ``sk-`` keys, ``hashed-jwt-<hex>``
    for a JWT, and the key itself for any other custom key: only a 64-digit hex digest is passed
    on; anything else is a key, never sent, and becomes a MAC under the tap's own key.
    """
    value = value.strip().lower().removeprefix("hashed-jwt-")
    if not value or _SHA256_RE.fullmatch(value):
        return value
    return hmac.new(key, value.encode(), hashlib.sha256).hexdigest()


def summarize(exchange: Exchange, fingerprinter: Fingerprinter) -> dict[str, Any]:
    """Return the record of ``exchange``: everything the monitor judges, and no text."""
    exchange = exchange.bounded()
    every_prompt_fp, prompt_cut = fingerprinter.fingerprints(exchange.prompt, cap=None)
    # The whole prompt's print first: two callers who sent the same prompt are told apart from a
    # leak when their answers match (a deterministic answer to one question is nobody's secret).
    whole = [fingerprinter.whole(exchange.prompt)] if exchange.prompt else []
    prompt_fp = [*whole, *every_prompt_fp][:MAX_FINGERPRINTS]
    response_fp, response_cut = fingerprinter.fingerprints(exchange.response)
    # The reader's own prompt, whole (not only the prints sent): a quote of it is no one else's text.
    own = set(every_prompt_fp)
    response_fp = [OWN if f in own else f for f in response_fp]
    markers = list(dict.fromkeys(m.group(0) for m in MARKER_RE.finditer(exchange.response)))
    status = exchange.status if isinstance(exchange.status, int) and 100 <= exchange.status <= 599 else 500
    return {
        # A gateway that gave no id gets one made here, once: a record resent after a lost
        # acknowledgement is then known again by the monitor (JetStream redelivers by message).
        "id": _name(exchange.request_id) or f"tap-{secrets.token_hex(12)}",
        "time": _epoch(exchange.started),
        # A caller named by its key is named by the key's digest: never by a key.
        "caller": key_digest(exchange.caller, fingerprinter.key)
        if exchange.caller_kind == "key_hash"
        else _name(exchange.caller),
        "caller_kind": exchange.caller_kind if exchange.caller_kind in CALLER_KINDS else "unknown",
        "key_hash": key_digest(exchange.key_hash, fingerprinter.key) if exchange.key_hash else "",
        "api_base": _name(exchange.api_base),
        "model": _name(exchange.model),
        "model_group": _name(exchange.model_group),
        "stream": bool(exchange.stream),
        "status": status,
        "finish_reason": _name(exchange.finish_reason) or None,
        "latency_seconds": _seconds(exchange.latency_seconds),
        "ttft_seconds": _seconds(exchange.ttft_seconds),
        "prompt": {
            "chars": exchange.prompt_chars,
            "bytes": exchange.prompt_bytes,
            "messages": min(max(int(exchange.messages), 0), 100_000),
        },
        "response_chars": exchange.response_chars,
        "usage": {
            "prompt_tokens": _count(exchange.prompt_tokens),
            "completion_tokens": _count(exchange.completion_tokens),
            "cached_tokens": _count(exchange.cached_tokens),
        },
        "markers": markers[:MAX_MARKERS],
        "fingerprints": {"prompt": prompt_fp, "response": response_fp},
        "truncated": prompt_cut or response_cut or len(whole) + len(every_prompt_fp) > MAX_FINGERPRINTS,
    }
