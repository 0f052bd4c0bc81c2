"""The routing rule as SQL: ``kvcanary.wire.api_base_key`` written so that DuckDB (the gateway's
logs) and PostgreSQL (LiteLLM's spend log) compute, for every logged ``api_base``, the key the
judge routes records by. A source compares that key with the scope's keys (``routed_keys``), so a
deployment is counted in a blast radius exactly where the judge would have routed its records.

Only functions both engines share are used, and none whose answer depends on a locale: ``ltrim``
and ``rtrim`` with the wire's ``BLANKS`` (as ``chr`` codes), ``translate`` over the ASCII letters
(``lower`` would lower-case non-ASCII letters, and each engine differently) and ``regexp_replace``
anchored at the end. The test ``tests/monitor/blast/test_blast_routing.py`` holds the three equal.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

from kvcanary import wire


def _chars(text: str) -> str:
    """``text`` as a SQL expression of ``chr`` codes: no quote or control character in the SQL."""
    return "(" + " || ".join(f"chr({ord(c)})" for c in text) + ")"


def api_base_key_sql(column: str) -> str:
    """Return a SQL expression of ``column``'s routing key (NULL for NULL), as the wire's rule has it."""
    blanks = _chars(wire.BLANKS)
    trimmed = f"ltrim(rtrim({column}, {blanks}), {blanks})"
    lowered = f"translate({trimmed}, '{string.ascii_uppercase}', '{string.ascii_lowercase}')"
    suffix = re.escape(wire.API_SUFFIX)  # "/v1": nothing to escape, and nothing to quote in SQL
    return f"rtrim(regexp_replace(rtrim({lowered}, '/'), '{suffix}$', ''), '/')"


def routed_keys(api_bases: Iterable[str]) -> list[str]:
    """Return the keys of a scope's API bases, sorted and once each: what the SQL's keys are compared with."""
    return sorted({wire.api_base_key(base) for base in api_bases})
