"""One exchange seen by a gateway, and the summary of it the monitor receives.

:class:`Exchange` is what a gateway knows about one request once its response is sent: who asked,
which deployment answered, how, and the texts (whole, or as their messages' parts). Building one
and queueing it costs a request nothing in proportion to the prompt: the texts are held by
reference. On the tap's thread, :meth:`Exchange.bounded` takes their sizes (UTF-8 bytes counted in
steps of ``COUNT_CHUNK_CHARS``, so that thread never holds the interpreter long from the gateway's
own) and cuts them to what the fingerprints read (head and tail, never joining more of the parts
than that), and :func:`summarize` turns the exchange into the record posted to
``/api/v1/traffic``: its own id (made once per exchange: the gateway's id is carried as
``upstream_id``, since engines repeat theirs), sizes, usage, timings, the marker-shaped strings of
the response (the monitor checks their seals), keyed fingerprints and keyed prints of the
distinctive tokens (``distinctive.py``). Every field is made to fit
the monitor's bounds here, and every name printable (:func:`printable_name`), so no customer's
input can get a batch refused or forge what a person reads. The texts go no further.
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

from kvcanary.tap.distinctive import TokenPrints
from kvcanary.tap.fingerprints import OWN, Fingerprinter, cut_joined, joined_length
from kvcanary.tap.words import scalars
from kvcanary.wire import (
    BLANKS,
    MAX_COUNT,
    MAX_FINGERPRINTS,
    MAX_INCIDENT_ID,
    MAX_MESSAGES,
    MAX_SECONDS,
    MAX_TIME,
    NAME_CHARS,
)
from kvcanary.wire import CALLER_KINDS as CALLER_KINDS
from kvcanary.wire import MARKER_RE as MARKER_RE
from kvcanary.wire import MAX_MARKERS as MAX_MARKERS
from kvcanary.wire import printable_name as printable_name

#: The most code points of a name (the protocol's ``NAME_CHARS``), as the tap's callers know it.
MAX_NAME_CHARS = NAME_CHARS
_HEX64_RE = re.compile("[0-9A-Fa-f]{64}")
#: The prefix LiteLLM puts before a JWT's SHA-256 (``hashed-jwt-<hex>``), in any ASCII case.
_JWT_PREFIX = "hashed-jwt-"
#: Characters of a non-ASCII text encoded at a time to count its UTF-8 bytes (about a millisecond).
COUNT_CHUNK_CHARS = 256 * 1024


@dataclass(frozen=True)
class Refusal:
    """The gateway refused the request before any upstream call (tap protocol version 3): its
    admission guard (the prompt surely over the pool of every deployment that would take it) or
    its quarantine (every deployment of the group quarantined). The record names the deployment
    refused in ``api_base``, so the monitor counts the refusal against its target."""

    by: str  # admission | quarantine
    tokens: int | None = None  # admission: the sure lower bound of the prompt's tokens
    kv_pool_tokens: int | None = None  # admission: the pool it was over
    incident_id: int | None = None  # quarantine: the incident that put it on

    def __post_init__(self) -> None:
        if self.by not in ("admission", "quarantine"):
            raise ValueError(f"a refusal is by admission or quarantine, not {self.by!r}")

    def wire(self) -> dict[str, Any]:
        return {
            "by": self.by,
            "tokens": _count(self.tokens),
            "kv_pool_tokens": _count(self.kv_pool_tokens),
            "incident_id": _count(self.incident_id, MAX_INCIDENT_ID),
        }


@dataclass
class Exchange:
    """One request and its response as the gateway saw them. Times are epoch seconds.

    ``request_id`` is the id the gateway reports for the response (LiteLLM's ``id``: the engine's
    response id), sent as the record's ``upstream_id``: data, never the record's identity, since
    engines and gateways repeat it (:func:`summarize`)."""

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
    #: The texts as their parts (a prompt's messages, a response's choices), to be joined by
    #: newlines; used in place of ``prompt`` and ``response`` when set. A gateway's hook that has
    #: them apart passes them so: joining them is work in proportion to the prompt, which
    #: :meth:`bounded` does on the tap's thread, and only for what is fingerprinted.
    prompt_parts: tuple[str, ...] | None = None
    response_parts: tuple[str, ...] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    #: The prompt's full size, when the texts were cut (:meth:`bounded`); None: ``prompt`` is whole.
    prompt_chars: int | None = None
    prompt_bytes: int | None = None
    response_chars: int | None = None
    #: Set when the gateway refused the request (no engine saw it): no prints are made of it.
    refused: Refusal | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def texts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Return the prompt's and the response's parts (one part each where given whole)."""
        prompt = self.prompt_parts if self.prompt_parts is not None else (self.prompt,)
        return prompt, self.response_parts if self.response_parts is not None else (self.response,)

    def held_chars(self) -> int:
        """Return the characters the exchange's texts hold, in time proportional to their parts."""
        return sum(joined_length(parts) for parts in self.texts())

    def bounded(self) -> Exchange:
        """Return this exchange with its sizes taken and its texts whole in ``prompt`` and
        ``response``, cut to what is fingerprinted. Work in proportion to the prompt (its UTF-8
        bytes are counted), in steps: for the tap's thread, never a request's."""
        if self.prompt_chars is not None:
            return self
        prompt, response = self.texts()
        return dataclasses.replace(
            self, prompt=cut_joined(prompt), response=cut_joined(response), prompt_parts=None,
            response_parts=None, prompt_chars=joined_length(prompt),
            prompt_bytes=sum(map(utf8_length, prompt)) + max(len(prompt) - 1, 0),
            response_chars=joined_length(response),
        )  # fmt: skip


def utf8_length(text: str) -> int:
    """Return the UTF-8 bytes of ``text`` read as scalar values (a surrogate as U+FFFD: three bytes,
    as ``surrogatepass`` writes it), encoding ``COUNT_CHUNK_CHARS`` at a time: one encode of a
    50 MB text holds the interpreter (the GIL) 50-100 ms, stalling every other
    thread of the gateway, its event loop's included; a chunk holds it about a millisecond."""
    if text.isascii():  # a flag of the string: no scan
        return len(text)
    return sum(
        len(text[start : start + COUNT_CHUNK_CHARS].encode("utf-8", "surrogatepass"))
        for start in range(0, len(text), COUNT_CHUNK_CHARS)
    )


def _count(value: object, most: int = MAX_COUNT) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most else None


def _seconds(value: object) -> float | None:
    """A duration, or None when it is not one (a wall clock stepped back between two readings)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if 0 <= value <= MAX_SECONDS else None


def _epoch(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return float(value) if 0 <= value <= MAX_TIME else 0.0


def key_digest(value: str, key: bytes) -> str:
    """Return a SHA-256 hex digest of a caller's key as the record may carry it.

    LiteLLM reports ``user_api_key_hash`` as the key's SHA-256 for ``sk-`` keys, ``hashed-jwt-<hex>``
    for a JWT, and the key itself for any other custom key. The rule (``docs/tap-protocol.md``,
    "Key digest"): trim ASCII white space; drop a ``hashed-jwt-`` prefix in any ASCII case; what is
    left, if 64 hex digits, is a digest already and goes lower-cased; empty goes empty; anything
    else is a key, never sent, and goes as HMAC-SHA256 under the tap's key of its UTF-8 bytes, case
    kept (two keys that differ in case are two callers), in lower-case hex.
    """
    value = value.strip(BLANKS)
    if value[: len(_JWT_PREFIX)].lower() == _JWT_PREFIX:
        value = value[len(_JWT_PREFIX) :]
    if not value or _HEX64_RE.fullmatch(value):
        return value.lower()
    return hmac.new(key, scalars(value).encode("utf-8"), hashlib.sha256).hexdigest()


def record_id() -> str:
    """Return a new record's identity: ``tap-`` and 24 hex digits (96 random bits), made once per
    exchange.

    The monitor judges a record once by this id (a resend after a lost acknowledgement, a JetStream
    redelivery), so it must differ between any two exchanges. No id from outside does: engines
    repeat response ids (a fixed id on every stream, a counter that restarts with the process),
    and LiteLLM's own ``litellm_call_id`` is the client's ``x-litellm-call-id`` header when one is
    sent. Any of them as the identity got a second response with a seen id acknowledged as a
    duplicate and never judged. The gateway's id goes as ``upstream_id``, data only."""
    return f"tap-{secrets.token_hex(12)}"


def summarize(exchange: Exchange, fingerprinter: Fingerprinter) -> dict[str, Any]:
    """Return the record of ``exchange``: everything the monitor judges, and no text. Its ``id``
    is made here (:func:`record_id`), once: the sender keeps the record, so a resend carries it."""
    exchange = exchange.bounded()
    if exchange.refused is not None:
        # No engine saw it, so nothing of it can be read back from one: no prints, no checks.
        exchange = dataclasses.replace(exchange, prompt="", response="")
    every_prompt_fp, prompt_cut = fingerprinter.fingerprints(exchange.prompt, cap=None)
    # The whole prompt's print first: two callers who sent the same prompt are told apart from a
    # leak when their answers match (a deterministic answer to one question is nobody's secret).
    whole = [fingerprinter.whole(exchange.prompt)] if exchange.prompt else []
    public = fingerprinter.public
    private_fp = [f for f in every_prompt_fp if f not in public] if public else every_prompt_fp
    prompt_fp = [*whole, *private_fp][:MAX_FINGERPRINTS]
    response_fp, response_cut = fingerprinter.fingerprints(exchange.response)
    # The reader's own prompt, whole (not only the prints sent): a quote of it is no one else's
    # text; nor is a public text's (``public.py``).
    own = set(every_prompt_fp)
    response_fp = [OWN if f in own or f in public else f for f in response_fp]
    asked, said = TokenPrints(fingerprinter.key).exchange(exchange.prompt, exchange.response)
    if public_tokens := fingerprinter.public_tokens:
        asked = [t for t in asked if t not in public_tokens]
        said = [t for t in said if t not in public_tokens]
    markers = list(dict.fromkeys(m.group(0) for m in MARKER_RE.finditer(exchange.response)))
    status = exchange.status if isinstance(exchange.status, int) and 100 <= exchange.status <= 599 else 500
    return {
        "id": record_id(),
        "upstream_id": printable_name(exchange.request_id),
        "time": _epoch(exchange.started),
        # A caller named by its key is named by the key's digest: never by a key.
        "caller": key_digest(exchange.caller, fingerprinter.key)
        if exchange.caller_kind == "key_hash"
        else printable_name(exchange.caller),
        "caller_kind": exchange.caller_kind if exchange.caller_kind in CALLER_KINDS else "unknown",
        "key_hash": key_digest(exchange.key_hash, fingerprinter.key) if exchange.key_hash else "",
        "api_base": printable_name(exchange.api_base),
        "model": printable_name(exchange.model),
        "model_group": printable_name(exchange.model_group),
        "stream": bool(exchange.stream),
        "status": status,
        "finish_reason": printable_name(exchange.finish_reason) or None,
        "latency_seconds": _seconds(exchange.latency_seconds),
        "ttft_seconds": _seconds(exchange.ttft_seconds),
        "prompt": {
            "chars": exchange.prompt_chars,
            "bytes": exchange.prompt_bytes,
            "messages": min(max(int(exchange.messages), 0), MAX_MESSAGES),
        },
        "response_chars": exchange.response_chars,
        "usage": {
            "prompt_tokens": _count(exchange.prompt_tokens),
            "completion_tokens": _count(exchange.completion_tokens),
            "cached_tokens": _count(exchange.cached_tokens),
        },
        "markers": markers[:MAX_MARKERS],
        "fingerprints": {"prompt": prompt_fp, "response": response_fp},
        "distinctive": {"prompt": asked, "response": said},
        "truncated": prompt_cut or response_cut or len(whole) + len(every_prompt_fp) > MAX_FINGERPRINTS,
    } | ({} if exchange.refused is None else {"refused": exchange.refused.wire()})
