"""Make what a target returned storable: text every backend keeps unchanged, plain JSON."""

from __future__ import annotations

import json
import math
from typing import Any

# Integers beyond JSON's safe range are kept as text: PostgreSQL and JavaScript readers lose them.
_JSON_INT_LIMIT = 2**53


_MAX_DEPTH = 32


def storable_text(value: str) -> str:
    """Return ``value`` as text every backend stores unchanged: NUL dropped, lone surrogates replaced.

    A target's answer can hold anything: PostgreSQL refuses NUL in text and ``\\u0000`` in JSON, and
    a lone surrogate (``"\\ud800"`` in a JSON string decodes to one) cannot be encoded as UTF-8 at all.
    """
    value = value.replace("\x00", "")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "replace").decode("utf-8")
    return value


def _plain(value: Any, depth: int = 0) -> Any:
    """Return ``value`` as plain JSON data: storable strings, finite numbers, nothing exotic.

    Work on the values, never on JSON text: editing escaped text breaks it (an answer holding the
    six characters ``\\u0000`` once made a leak unrecordable).
    """
    if isinstance(value, str):
        return storable_text(value)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) < _JSON_INT_LIMIT else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # NaN and inf are not JSON
    if depth >= _MAX_DEPTH:
        return storable_text(str(value))
    if isinstance(value, dict):
        return {storable_text(str(k)): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    return storable_text(str(value))  # a set, bytes, an object: its str()


def jsonable(evidence: dict[str, Any]) -> dict[str, Any]:
    """Return ``evidence`` as plain JSON that both databases store the same way.

    A value JSON cannot hold (a set, bytes, NaN) becomes its ``str()``; text is made storable
    (:func:`storable_text`): a probe's odd value must not cost the recording of a leak.
    """
    plain = _plain(evidence or {})
    # Round-trip once: what is stored is exactly what a reader will get back.
    return dict(json.loads(json.dumps(plain)))
