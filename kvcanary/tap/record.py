"""One exchange seen by a gateway, and the summary of it the monitor receives.

:class:`Exchange` is what a gateway knows about one request once its response is sent: who asked,
which deployment answered, how, and the texts. :func:`summarize` turns it into the record posted to
``/api/v1/traffic``: sizes, usage, timings, the marker-shaped strings of the response (the monitor
checks their seals) and keyed fingerprints. The texts themselves go no further than this function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvcanary.tap.fingerprints import Fingerprinter

#: The shape of a kvcanary marker (``probes/markers.py``: ``KVC-<8 hex id>-<32 hex secret>``), any
#: case. The monitor opens each one; a string of this shape it did not seal is nobody's marker.
MARKER_RE = re.compile(r"KVC-[0-9a-f]{8}-[0-9a-f]{32}", re.IGNORECASE)
MAX_MARKERS = 32
#: Bounds of the strings a record names (ids, callers, deployments); longer ones are cut.
MAX_NAME_CHARS = 200


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
    extra: dict[str, Any] = field(default_factory=dict)


def _name(value: object) -> str:
    return str(value or "")[:MAX_NAME_CHARS]


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def summarize(exchange: Exchange, fingerprinter: Fingerprinter) -> dict[str, Any]:
    """Return the record of ``exchange``: everything the monitor judges, and no text."""
    prompt_fp, prompt_cut = fingerprinter.fingerprints(exchange.prompt)
    response_fp, response_cut = fingerprinter.fingerprints(exchange.response)
    markers = list(dict.fromkeys(m.group(0) for m in MARKER_RE.finditer(exchange.response)))
    return {
        "id": _name(exchange.request_id),
        "time": exchange.started,
        "caller": _name(exchange.caller),
        "caller_kind": exchange.caller_kind,
        "key_hash": _name(exchange.key_hash),
        "api_base": _name(exchange.api_base),
        "model": _name(exchange.model),
        "model_group": _name(exchange.model_group),
        "stream": exchange.stream,
        "status": exchange.status,
        "finish_reason": _name(exchange.finish_reason) or None,
        "latency_seconds": exchange.latency_seconds,
        "ttft_seconds": exchange.ttft_seconds,
        "prompt": {
            "chars": len(exchange.prompt),
            "bytes": len(exchange.prompt.encode("utf-8", "surrogatepass")),
            "messages": exchange.messages,
        },
        "response_chars": len(exchange.response),
        "usage": {
            "prompt_tokens": _count(exchange.prompt_tokens),
            "completion_tokens": _count(exchange.completion_tokens),
            "cached_tokens": _count(exchange.cached_tokens),
        },
        "markers": markers[:MAX_MARKERS],
        "fingerprints": {"prompt": prompt_fp, "response": response_fp},
        "truncated": prompt_cut or response_cut,
    }
