"""The log formats a blast radius reads, each a mapping of its fields onto the normal columns
every source counts: ``request_id``, ``caller``, ``key_hash``, ``t`` (epoch seconds), ``ok``
(answered 2xx), ``api_base``, ``prompt_tokens`` (as reported) and ``prompt_chars``.

- ``litellm``: LiteLLM's standard logging payload, one per line (what its logging callbacks and
  bucket loggers write). The caller is named as the tap names it: the team, else the key's alias,
  else its hash, else the end user.
- ``sglang``: SGLang's request log (``--log-requests --log-requests-format json``), its
  ``request.finished`` lines. It logs one node, so every line is the node's (no ``api_base``). Its
  prompt text is cut past 2,048 characters at the default level, and its own count is what an
  over-capacity defect falsifies: a longer prompt is sized by the count alone. It names no key:
  the monitor's own probes cannot be told apart.
- ``openai``: a generic record: ``id`` (or ``request_id``), ``time`` (epoch seconds or ISO 8601;
  without an offset, UTC), ``caller`` (or ``user``), ``key_hash``, ``api_base`` (none: the log is
  the node's own), ``status`` (HTTP), ``request`` (the OpenAI request body: ``messages`` or
  ``prompt``) and ``usage.prompt_tokens``.

The text is read only to be measured, inside DuckDB; nothing of it leaves.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

#: The fields each format is read with, and their DuckDB types (nested objects are read as JSON).
COLUMNS: dict[str, dict[str, str]] = {
    "litellm": {
        "id": "VARCHAR", "startTime": "DOUBLE", "status": "VARCHAR", "api_base": "VARCHAR",
        "prompt_tokens": "BIGINT", "end_user": "VARCHAR", "messages": "JSON", "metadata": "JSON",
    },
    "sglang": {
        "timestamp": "VARCHAR", "event": "VARCHAR", "rid": "VARCHAR", "obj": "JSON", "out": "JSON",
        "headers": "JSON",
    },
    "openai": {
        "id": "VARCHAR", "request_id": "VARCHAR", "time": "VARCHAR", "caller": "VARCHAR", "user": "VARCHAR",
        "key_hash": "VARCHAR", "api_base": "VARCHAR", "status": "INTEGER", "request": "JSON", "usage": "JSON",
    },
}  # fmt: skip

#: Characters of an OpenAI ``messages`` value (text parts only; a plain string counts whole).
_MESSAGE_CHARS = """CASE json_type(CAST({m} AS JSON))
  WHEN 'VARCHAR' THEN length(CAST({m} AS JSON)->>'$')
  WHEN 'ARRAY' THEN coalesce(list_sum(list_transform(
    json_extract(CAST({m} AS JSON), '$[*].content'), lambda c:
    CASE json_type(c) WHEN 'VARCHAR' THEN length(c->>'$')
      WHEN 'ARRAY' THEN coalesce(list_sum(list_transform(json_extract_string(c, '$[*].text'),
                                                         lambda x: coalesce(length(x), 0))), 0)
      ELSE 0 END)), 0)
  ELSE NULL END"""


def _digest(value: str) -> str:
    """A key hash as the tap passes one on: a 64-digit SHA-256 as it is (LiteLLM's ``hashed-jwt-``
    prefix dropped), anything else (LiteLLM reports keys that are not ``sk-`` keys raw) as its
    SHA-256, so that a raw key never becomes a caller's name, and a tenant's key is still known."""
    bare = f"regexp_replace({value}, '^hashed-jwt-', '')"
    # No braces in the SQL: the normal queries are str.format templates.
    digest = f"length({bare}) = 64 AND regexp_full_match({bare}, '[0-9a-f]+')"
    return f"(CASE WHEN {digest} THEN {bare} ELSE sha256({value}) END)"


def _meta(key: str) -> str:
    """A field of LiteLLM's ``metadata`` (a struct in Parquet, an object in JSON: read as JSON both)."""
    return f"nullif(CAST(metadata AS JSON)->>'$.{key}', '')"


#: A time as epoch seconds: a number, or ISO 8601 (read as UTC where it has no offset; the
#: connection's time zone is UTC).
_EPOCH = "coalesce(TRY_CAST({v} AS DOUBLE), epoch(TRY_CAST({v} AS TIMESTAMPTZ)))"

NORMAL = {
    "litellm": f"""SELECT id AS request_id,
        coalesce({_meta("user_api_key_team_id")}, {_meta("user_api_key_alias")},
                 {_digest(_meta("user_api_key_hash"))},
                 nullif(end_user, ''), {_meta("user_api_key_end_user_id")}, '') AS caller,
        coalesce({_digest(_meta("user_api_key_hash"))}, '') AS key_hash, startTime AS t,
        status = 'success' AS ok,
        coalesce(api_base, '') AS api_base, prompt_tokens,
        {_MESSAGE_CHARS.format(m="messages")} AS prompt_chars FROM {{raw}}""",
    "sglang": f"""SELECT rid AS request_id,
        coalesce(headers->>'$."x-smg-routing-key"', obj->>'$.routing_key', obj->>'$.conversation_id', '')
          AS caller,
        '' AS key_hash,
        coalesce(TRY_CAST(obj->>'$.received_time' AS DOUBLE), {_EPOCH.format(v='"timestamp"')}) AS t,
        coalesce(out->>'$.meta_info.finish_reason.type', '') <> 'abort' AS ok, NULL::VARCHAR AS api_base,
        TRY_CAST(out->>'$.meta_info.prompt_tokens' AS BIGINT) AS prompt_tokens,
        CASE WHEN length(obj->>'$.text') < 2048 THEN length(obj->>'$.text') END AS prompt_chars
        FROM {{raw}} WHERE event = 'request.finished' OR event IS NULL""",
    "openai": f"""SELECT coalesce(id, request_id) AS request_id, coalesce(caller, "user", '') AS caller,
        coalesce({_digest("nullif(key_hash, '')")}, '') AS key_hash, {_EPOCH.format(v='"time"')} AS t,
        coalesce(status, 200) BETWEEN 200 AND 299 AS ok, api_base,
        TRY_CAST(usage->>'$.prompt_tokens' AS BIGINT) AS prompt_tokens,
        CASE WHEN (request->'$.messages') IS NOT NULL
             THEN {_MESSAGE_CHARS.format(m="(request->'$.messages')")}
             ELSE length(request->>'$.prompt') END AS prompt_chars FROM {{raw}}""",
}


def format_of_keys(keys: set[str]) -> str:
    if {"startTime", "metadata"} <= keys:
        return "litellm"
    if {"event", "rid"} <= keys or {"rid", "obj"} <= keys:
        return "sglang"
    return "openai"


#: The longest log line read, in bytes: DuckDB's default ``maximum_object_size``, which ``logs.py``
#: states to it. A LiteLLM payload carries the prompt, and a million-token prompt is about 4 MB.
LINE_BYTES = 16 * 1024 * 1024
#: Telling a format reads at most ``LINE_BYTES`` of a file (decompressed), and parses only lines of
#: at most this many bytes: the keys that tell a format are in every record, short ones too.
PARSE_BYTES = 1024 * 1024


class LongLine(ValueError):
    """A file's first line runs past ``LINE_BYTES``: no log line is that long, and it is not read."""


def first_json_keys(path: str, lines: int = 1000) -> set[str] | None:
    """Return the keys of the first JSON object among a file's first ``lines`` lines (a ``.gz`` file,
    as logrotate leaves them, read through gzip, as DuckDB reads it); None: there is none.

    Whatever the file holds, at most ``LINE_BYTES`` are read and a line over ``PARSE_BYTES`` is
    passed over unparsed: the memory this takes is bounded by those two, not by the file. Raise
    ``LongLine`` when the first line alone runs past ``LINE_BYTES``; ``OSError`` when the file
    cannot be read.
    """
    opener: Any = gzip.open if path.endswith(".gz") else open
    left = LINE_BYTES
    with opener(path, "rb") as handle:
        for n in range(lines):
            line = handle.readline(left)
            left -= len(line)
            if not line.endswith(b"\n") and left <= 0:  # cut at the bound, not at a newline
                if n == 0:
                    raise LongLine(f"a line over {LINE_BYTES} bytes")
                return None
            if not line:
                return None
            if len(line) > PARSE_BYTES:
                continue
            try:
                found: Any = json.loads(line.decode("utf-8", errors="replace"))
            except ValueError:
                continue
            if isinstance(found, dict):
                return set(found)
    return None
