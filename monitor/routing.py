"""Routing: which target (and node) a gateway's ``api_base`` names, in the one place traffic, the
blast radius and containment read it.

- :func:`api_base_key`: ``kvcanary.wire.api_base_key``, the one rule the taps' partitions follow
  too, kept in a cache (every record asks; a gateway has a few deployments);
- :func:`routes_of`: ``{key: (target, node)}`` for every configured target, node and mapping;
- :func:`api_base_key_sql`: the same rule written so that DuckDB (the gateway's logs) and
  PostgreSQL (LiteLLM's spend log) compute, for every logged ``api_base``, the key the judge routes
  records by; a blast-radius source compares it with the scope's keys (:func:`routed_keys`), so a
  deployment is counted exactly where the judge would have routed its records.

For the SQL, only functions both engines share are used, and none whose answer depends on a locale: ``ltrim``
and ``rtrim`` with the wire's ``BLANKS`` (as ``chr`` codes), ``translate`` over the ASCII letters
(``lower`` would lower-case non-ASCII letters, and each engine differently) and ``regexp_replace``
anchored at the end. The test ``tests/monitor/blast/test_blast_routing.py`` holds the three equal.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvcanary import wire

if TYPE_CHECKING:
    from kvcanary.monitor.config.settings import Settings


@functools.lru_cache(maxsize=4096)
def api_base_key(url: str) -> str:
    """Return the form routes compare (``kvcanary.wire.api_base_key``)."""
    return wire.api_base_key(url)


def routes_of(settings: Settings) -> dict[str, tuple[str, str]]:
    """Return ``{api base key: (target, node)}`` for every configured target, node and mapping (a
    target's own ``base_url`` and ``gateway_api_bases`` name the target; a node's URL the node)."""
    routes: dict[str, tuple[str, str]] = {}
    for target in settings.targets:
        routes[api_base_key(target.base_url)] = (target.name, "")
        for node in target.node_list():
            if node.name:
                routes.setdefault(api_base_key(node.info_url), (target.name, node.name))
        for base in target.gateway_api_bases:
            routes[api_base_key(base)] = (target.name, "")
    return routes


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
