"""A gateway's log files, scanned in place with DuckDB: JSON lines or Parquet, never copied.

Each format is a mapping of its fields onto the columns every source counts (``NORMAL``): request
id, caller, key hash, start time (epoch seconds), answered 2xx, API base, reported prompt tokens
and the prompt's characters. The text itself is read only to be measured, inside DuckDB.

- ``litellm``: LiteLLM's standard logging payload, one per line (what its logging callbacks and
  bucket loggers write). The caller is named as the tap names it: the team, else the key's alias,
  else its hash, else the end user.
- ``sglang``: SGLang's request log (``--log-requests --log-requests-format json``), its
  ``request.finished`` lines. It logs one node, so every line is taken as the incident's node's.
  Its prompt text is cut past 2,048 characters at the default level, and its own count is what
  an over-capacity defect falsifies: a prompt longer than that is sized by the count alone.
- ``openai``: a generic record: ``id`` (or ``request_id``), ``time`` (epoch seconds or ISO 8601),
  ``caller`` (or ``user``), ``key_hash``, ``api_base``, ``status`` (HTTP), ``request`` (the
  OpenAI request body: ``messages`` or ``prompt``) and ``usage.prompt_tokens``.

A line that is not JSON of the format is counted as unreadable, not fatal.
"""

from __future__ import annotations

import glob as globbing
import json
from pathlib import Path
from typing import Any

from monitor.blast.question import Scope
from monitor.blast.tally import Tally
from monitor.traffic.checks import TOKENS_MARGIN

FORMATS = ("litellm", "sglang", "openai")

_LITELLM_COLUMNS = {
    "id": "VARCHAR", "startTime": "DOUBLE", "status": "VARCHAR", "api_base": "VARCHAR",
    "prompt_tokens": "BIGINT", "end_user": "VARCHAR", "messages": "JSON",
    "metadata": "JSON",
}  # fmt: skip
_SGLANG_COLUMNS = {
    "timestamp": "VARCHAR",
    "event": "VARCHAR",
    "rid": "VARCHAR",
    "obj": "JSON",
    "out": "JSON",
    "headers": "JSON",
}
_OPENAI_COLUMNS = {
    "id": "VARCHAR", "request_id": "VARCHAR", "time": "VARCHAR", "caller": "VARCHAR", "user": "VARCHAR",
    "key_hash": "VARCHAR", "api_base": "VARCHAR", "status": "INTEGER", "request": "JSON",
    "usage": "STRUCT(prompt_tokens BIGINT)",
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


def _meta(key: str) -> str:
    """A field of LiteLLM's ``metadata`` (a struct in Parquet, an object in JSON: read as JSON both)."""
    return f"(CAST(metadata AS JSON)->>'$.{key}')"


_NORMAL = {
    "litellm": f"""SELECT id AS request_id,
        coalesce(nullif({_meta("user_api_key_team_id")}, ''), nullif({_meta("user_api_key_alias")}, ''),
                 nullif({_meta("user_api_key_hash")}, ''),
                 nullif(coalesce(end_user, {_meta("user_api_key_end_user_id")}), ''), '') AS caller,
        coalesce({_meta("user_api_key_hash")}, '') AS key_hash, startTime AS t, status = 'success' AS ok,
        api_base, prompt_tokens, {_MESSAGE_CHARS.format(m="messages")} AS prompt_chars FROM raw""",
    "sglang": """SELECT rid AS request_id,
        coalesce(headers->>'$."x-smg-routing-key"', obj->>'$.routing_key', obj->>'$.conversation_id', '')
          AS caller,
        '' AS key_hash,
        coalesce(TRY_CAST(obj->>'$.received_time' AS DOUBLE), epoch(TRY_CAST("timestamp" AS TIMESTAMP))) AS t,
        coalesce(out->>'$.meta_info.finish_reason.type', '') <> 'abort' AS ok, NULL::VARCHAR AS api_base,
        TRY_CAST(out->>'$.meta_info.prompt_tokens' AS BIGINT) AS prompt_tokens,
        CASE WHEN length(obj->>'$.text') < 2048 THEN length(obj->>'$.text') END AS prompt_chars
        FROM raw WHERE event = 'request.finished' OR event IS NULL""",
    "openai": f"""SELECT coalesce(id, request_id) AS request_id, coalesce(caller, "user", '') AS caller,
        coalesce(key_hash, '') AS key_hash,
        coalesce(TRY_CAST("time" AS DOUBLE), epoch(TRY_CAST("time" AS TIMESTAMPTZ))) AS t,
        coalesce(status, 200) BETWEEN 200 AND 299 AS ok, api_base, usage.prompt_tokens AS prompt_tokens,
        CASE WHEN request->'$.messages' IS NOT NULL THEN {_MESSAGE_CHARS.format(m="request->'$.messages'")}
             ELSE length(request->>'$.prompt') END AS prompt_chars FROM raw""",
}


def detect_format(paths: list[str]) -> str:
    """Name the format of the first JSON line of the first file (Parquet: by its columns)."""
    first = paths[0]
    if first.endswith(".parquet"):
        import duckdb

        described = duckdb.connect().execute(f"DESCRIBE SELECT * FROM read_parquet({_quote(first)})")
        names = {r[0] for r in described.fetchall()}
        return _format_of(names)
    with open(first, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                return _format_of(set(json.loads(line)))
            except (ValueError, TypeError):
                continue
    raise ValueError(f"{first}: no JSON line to tell the log's format from")


def _format_of(keys: set[str]) -> str:
    if {"startTime", "metadata"} <= keys:
        return "litellm"
    if {"event", "rid"} <= keys or {"rid", "obj"} <= keys:
        return "sglang"
    return "openai"


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def expand(pattern: str) -> list[str]:
    return sorted(p for p in globbing.glob(pattern, recursive=True) if Path(p).is_file())


def estimate_sql(chars_per_token: float | None) -> str:
    """The prompt's size in tokens as ``monitor.traffic.checks.prompt_estimate`` has it."""
    if not chars_per_token:
        return "prompt_tokens"
    floor = f"(prompt_chars / {float(chars_per_token)!r})"
    return (
        f"CASE WHEN prompt_chars IS NULL THEN prompt_tokens "
        f"WHEN prompt_tokens IS NOT NULL AND prompt_tokens * {TOKENS_MARGIN!r} >= {floor} THEN prompt_tokens "
        f"ELSE {floor} END"
    )


def match_sql(scope: Scope, routed: str) -> str:
    """The SQL condition of a matching row over the normal columns (``routed``: reaches the node)."""
    if scope.criterion.kind == "over_pool":
        pool = int(scope.criterion.pool_tokens or 0)
        return f"{routed} AND ok AND ({estimate_sql(scope.chars_per_token)}) > {pool}"
    return f"{routed} AND ok"


def logs_tally(pattern: str, scope: Scope, fmt: str = "auto", threads: int = 1) -> tuple[Tally, str]:
    """Count the matching requests in the files ``pattern`` names; return the tally and the format."""
    tally = Tally("gateway logs", pattern)
    paths = expand(pattern)
    if not paths:
        tally.notes.append(f"no file matches {pattern}")
        return tally, fmt
    fmt = detect_format(paths) if fmt == "auto" else fmt
    tally.detail = f"{pattern} ({len(paths)} file(s), {fmt})"
    if scope.criterion.kind in ("flagged", "none"):
        tally.notes.append(
            "a log holds no check's verdict: only the monitor's recorded traffic answers this criterion"
        )
        return tally, fmt
    with _connect(threads) as con:
        _register(con, paths, fmt)
        rows = con.execute(_GROUPED.format(match=match_sql(scope, _ROUTED), bucket=scope.bucket_seconds),
                           _params(scope)).fetchall()  # fmt: skip
    _add(tally, rows, fmt)
    return tally, fmt


def logs_requests(
    pattern: str, scope: Scope, fmt: str, limit: int, threads: int = 1
) -> list[tuple[str, str, bool, float]]:
    paths = expand(pattern)
    if not paths or scope.criterion.kind in ("flagged", "none"):
        return []
    with _connect(threads) as con:
        _register(con, paths, detect_format(paths) if fmt == "auto" else fmt)
        query = f"""SELECT request_id, caller, own, t FROM ({_ANNOTATED}) WHERE request_id IS NOT NULL
                    AND t BETWEEN $start AND $end AND {match_sql(scope, _ROUTED)}
                    ORDER BY t LIMIT {int(limit)}"""
        return [(r, c, bool(o), float(t)) for r, c, o, t in con.execute(query, _params(scope)).fetchall()]


def _connect(threads: int) -> Any:
    import duckdb  # imported here: only a blast radius over log files needs it

    con = duckdb.connect(config={"threads": max(1, threads), "enable_external_access": True})
    return con


def _register(con: Any, paths: list[str], fmt: str) -> None:
    files = "[" + ", ".join(_quote(p) for p in paths) + "]"
    if all(p.endswith(".parquet") for p in paths):
        source = f"read_parquet({files}, union_by_name = true)"
    else:
        columns = {"litellm": _LITELLM_COLUMNS, "sglang": _SGLANG_COLUMNS, "openai": _OPENAI_COLUMNS}[fmt]
        spec = "{" + ", ".join(f"{_quote(k)}: {_quote(v)}" for k, v in columns.items()) + "}"
        source = f"read_json({files}, format = 'newline_delimited', ignore_errors = true, columns = {spec})"
    con.execute(f"CREATE TEMP VIEW raw AS SELECT * FROM {source}")
    con.execute(f"CREATE TEMP VIEW normal AS {_NORMAL[fmt]}")


_ANNOTATED = """SELECT *, list_contains($own, key_hash) AS own,
    api_base IS NULL
      OR list_contains($bases, regexp_replace(rtrim(lower(api_base), '/'), '/v1$', '')) AS routed
    FROM normal"""
_ROUTED = "routed"
_GROUPED = (
    """SELECT CASE WHEN m THEN caller END, CASE WHEN m THEN own END,
       CASE WHEN m THEN CAST(floor((t - $start) / {bucket}) AS BIGINT) ELSE -1 END AS bucket,
       count(*) FILTER (WHERE m), min(t) FILTER (WHERE m), max(t) FILTER (WHERE m),
       count(*), count(*) FILTER (WHERE request_id IS NULL), count(*) FILTER (WHERE in_scope)
FROM (SELECT *, coalesce(request_id IS NOT NULL AND t BETWEEN $start AND $end AND {match}, false) AS m,
             coalesce(request_id IS NOT NULL AND t BETWEEN $start AND $end AND routed, false) AS in_scope
      FROM ("""
    + _ANNOTATED
    + """))
GROUP BY ALL"""
)


def _params(scope: Scope) -> dict[str, Any]:
    return {
        "start": scope.start_epoch,
        "end": scope.end_epoch,
        "own": sorted(scope.own_keys),
        "bases": [b.lower() for b in scope.api_bases],
    }


def _add(tally: Tally, rows: list[tuple[Any, ...]], fmt: str) -> None:
    seen = unreadable = in_scope = 0
    groups = []
    for caller, own, bucket, n, first, last, total, bad, scoped in rows:
        seen, unreadable, in_scope = seen + total, unreadable + bad, in_scope + scoped
        if n:
            groups.append((caller, own, bucket, n, first, last))
    tally.add_groups(groups)
    tally.rows_read = seen
    tally.covered = in_scope > 0
    if not tally.covered:
        tally.notes.append("the logs hold no request to this node in the window")
    if unreadable:
        tally.notes.append(f"{unreadable} line(s) were not {fmt} log records and were skipped")
    if fmt == "sglang":
        tally.notes.append(
            "SGLang's log cuts prompts past 2,048 characters: those are sized by the engine's own count"
        )
