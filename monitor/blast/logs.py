"""A gateway's log files, scanned in place with DuckDB: JSON lines or Parquet, never copied.

Every configured glob is read as one source: the files (each once, whatever globs name it) are
grouped by format (``log_formats.py``: given, or told from each file's first JSON line or its
Parquet columns), each group mapped onto the normal columns, and the groups read as one union. A
line that is no record of its format is counted as unreadable; a file with no record, or that
DuckDB cannot read, is counted in the tally's notes, never fatal. Every JSON-lines file is first
checked with a bounded read, whatever it holds (``log_formats.first_json_keys``): one whose first
line runs past ``LINE_BYTES`` is left out unread, with a note. Notes name no path and quote no
input (the incident page shows them, and an error's input may be a prompt): the files read are
in the tally's ``detail``, which only the API and the CLI show. The connection's time zone is UTC,
so a time without an offset is UTC. A line reaches the node where it names no ``api_base`` or where
its ``api_base``'s routing key is one of the scope's (``routing.py``: the judge's rule, as SQL).
"""

from __future__ import annotations

import glob as globbing
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from kvcanary.monitor.blast.log_formats import (
    COLUMNS,
    LINE_BYTES,
    NORMAL,
    LongLine,
    first_json_keys,
    format_of_keys,
)
from kvcanary.monitor.blast.question import Scope
from kvcanary.monitor.blast.source import RequestRow, Tally
from kvcanary.monitor.routing import api_base_key_sql, routed_keys
from kvcanary.monitor.traffic.checks import TOKENS_MARGIN

log = logging.getLogger("kvcanary.blast")
LogSource = tuple[str, str]  # (glob, format: auto | litellm | sglang | openai)
#: The note on a file left out for its first line: the size only (its start may be a prompt).
LONG_LINE = f"a file whose first line runs past {LINE_BYTES // 2**20} MiB, which no log line does (not read)"


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


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _connect(threads: int) -> Any:
    import duckdb  # imported here: only a blast radius over log files needs it

    con = duckdb.connect(config={"threads": max(1, threads)})
    con.execute("SET TimeZone = 'UTC'")
    return con


class LogFiles:
    """The files the globs name, by format, and what could not be read of them."""

    def __init__(self, sources: list[LogSource]):
        self.sources = sources
        self.notes: list[str] = []
        self.groups: dict[tuple[str, bool], list[str]] = defaultdict(list)  # (format, parquet) -> paths
        self.skipped: Counter[str] = Counter()  # why files were left out, counted (no paths: see module doc)
        seen: set[str] = set()
        for pattern, fmt in sources:
            paths = sorted(p for p in globbing.glob(pattern, recursive=True) if Path(p).is_file())
            if not paths:
                self.skipped["a glob that matches no file"] += 1
            for path in paths:
                real = os.path.realpath(path)  # one file reached by two globs or a link: read once
                if real not in seen:
                    seen.add(real)
                    self._add(path, fmt)
        self.notes += [f"{why} ({n} times)" if n > 1 else why for why, n in sorted(self.skipped.items())]

    def _add(self, path: str, fmt: str) -> None:
        parquet = path.endswith(".parquet")
        try:  # every file is checked whatever its format: one bad file must not cost the others
            keys = self._parquet_columns(path) if parquet else first_json_keys(path)
        except LongLine:  # the file is left out unread (DuckDB would refuse the whole read for it)
            self.skipped[LONG_LINE] += 1
            return
        except Exception as exc:  # a file DuckDB or the OS cannot read: counted, not fatal
            self.skipped[f"a file not read ({type(exc).__name__})"] += 1
            return
        if fmt == "auto":
            if not keys:
                self.skipped["a file with no JSON record in its first lines"] += 1
                return
            fmt = format_of_keys(keys)
        self.groups[(fmt, parquet)].append(path)

    @staticmethod
    def _parquet_columns(path: str) -> set[str]:
        with _connect(1) as con:
            return {
                r[0] for r in con.execute(f"DESCRIBE SELECT * FROM read_parquet({_quote(path)})").fetchall()
            }

    @property
    def files(self) -> int:
        return sum(len(p) for p in self.groups.values())

    def describe(self) -> str:
        formats = sorted({fmt for fmt, _ in self.groups})
        return (
            f"{', '.join(g for g, _ in self.sources)} ({self.files} file(s): {', '.join(formats) or 'none'})"
        )

    def register(self, con: Any) -> None:
        """Create the view ``normal``: every group mapped onto the normal columns, as one union."""
        parts = []
        for n, ((fmt, parquet), paths) in enumerate(sorted(self.groups.items())):
            files = "[" + ", ".join(_quote(p) for p in paths) + "]"
            columns = COLUMNS[fmt]
            if parquet:
                present = {
                    r[0]
                    for r in con.execute(
                        f"DESCRIBE SELECT * FROM read_parquet({files}, union_by_name = true)"
                    ).fetchall()
                }
                # Each column as the format reads it, whatever type the file stored it as.
                chosen = ", ".join(
                    f'TRY_CAST("{c}" AS {t}) AS "{c}"' if c in present else f'NULL::{t} AS "{c}"'
                    for c, t in columns.items()
                )
                source = f"SELECT {chosen} FROM read_parquet({files}, union_by_name = true)"
            else:
                spec = "{" + ", ".join(f"{_quote(k)}: {_quote(v)}" for k, v in columns.items()) + "}"
                options = (
                    f"format = 'newline_delimited', ignore_errors = true, columns = {spec}, "
                    f"maximum_object_size = {LINE_BYTES}"
                )
                source = f"SELECT * FROM read_json({files}, {options})"
            con.execute(f"CREATE TEMP VIEW raw{n} AS {source}")
            parts.append(NORMAL[fmt].format(raw=f"raw{n}"))
        con.execute("CREATE TEMP VIEW normal AS " + " UNION ALL ".join(f"({p})" for p in parts))


_ANNOTATED = f"""SELECT *, list_contains($own, key_hash) AS own,
    api_base IS NULL OR list_contains($bases, {api_base_key_sql("api_base")}) AS routed
    FROM normal"""
#: One pass over the files: caller groups, the customers' buckets and the totals, as grouping
#: sets; ``GROUPING(c, o, b)`` tells them apart (``SETS``).
_GROUPED = """SELECT GROUPING(c, o, b) AS g, c, o, b,
       count(*) FILTER (WHERE m), min(t) FILTER (WHERE m), max(t) FILTER (WHERE m),
       count(*), count(*) FILTER (WHERE request_id IS NULL), count(*) FILTER (WHERE in_scope),
       min(t) FILTER (WHERE request_id IS NOT NULL), max(t) FILTER (WHERE request_id IS NOT NULL)
FROM (SELECT *, CASE WHEN m THEN caller END AS c, CASE WHEN m THEN own END AS o,
             CASE WHEN m AND NOT own AND NOT list_contains($exclude, caller)
                  THEN CAST(floor((t - $start) / {bucket}) AS BIGINT) END AS b
      FROM (SELECT *, coalesce(inside AND {match}, false) AS m, coalesce(inside AND routed, false) AS in_scope
            FROM (SELECT *, request_id IS NOT NULL AND t BETWEEN $start AND $end AS inside
                  FROM (""" + _ANNOTATED + """))))
GROUP BY GROUPING SETS ((c, o), (b), ())"""  # fmt: skip


#: ``GROUPING(c, o, b)`` of each grouping set: a bit is set for each column the set leaves out.
SETS = {"callers": 0b001, "buckets": 0b110, "totals": 0b111}


def _params(scope: Scope) -> dict[str, Any]:
    return {
        "start": scope.start_epoch,
        "end": scope.end_epoch,
        "own": sorted(scope.own_keys),
        "bases": routed_keys(scope.api_bases),
        "exclude": list(scope.exclude),
    }


def logs_tally(sources: list[LogSource], scope: Scope, threads: int = 1) -> Tally:
    """Count the matching requests in the files the globs name."""
    tally = Tally(GatewayLogs.name, ", ".join(g for g, _ in sources))
    if scope.criterion.kind in ("flagged", "none"):
        tally.notes.append(
            "a log holds no check's verdict: only the monitor's recorded traffic answers this criterion"
        )
        return tally
    files = LogFiles(sources)
    tally.detail, tally.notes = files.describe(), files.notes
    if not files.groups:
        return tally
    try:
        with _connect(threads) as con:
            files.register(con)
            query = _GROUPED.format(match=match_sql(scope, "routed"), bucket=scope.bucket_seconds)
            rows = con.execute(query, _params(scope)).fetchall()
    except Exception as exc:  # a file DuckDB cannot read as its format: the source says so
        # The type only: DuckDB's message quotes the input, which may be a customer's prompt.
        tally.notes.append(f"the logs could not be read ({type(exc).__name__})")
        log.warning("blast radius: the logs could not be read: %s", type(exc).__name__)
        return tally
    _add(tally, rows, files)
    return tally


def logs_requests(sources: list[LogSource], scope: Scope, limit: int, threads: int = 1) -> list[RequestRow]:
    files = LogFiles(sources)
    if not files.groups or scope.criterion.kind in ("flagged", "none"):
        return []
    with _connect(threads) as con:
        files.register(con)
        query = f"""SELECT request_id, caller, own, t FROM ({_ANNOTATED}) WHERE request_id IS NOT NULL
                    AND t BETWEEN $start AND $end AND {match_sql(scope, "routed")}
                    ORDER BY t LIMIT {int(limit)}"""
        params = {k: v for k, v in _params(scope).items() if k != "exclude"}  # DuckDB refuses unused ones
        return [(r, c, bool(o), float(t)) for r, c, o, t in con.execute(query, params).fetchall()]


def _add(tally: Tally, rows: list[tuple[Any, ...]], files: LogFiles) -> None:
    seen = unreadable = in_scope = 0
    spans: list[float] = []
    for g, caller, own, bucket, n, first, last, total, bad, scoped, lo, hi in rows:
        if g == SETS["callers"] and n:  # the rows that do not match make a group of no caller: n = 0
            tally.add_callers([(caller, own, n, first, last)])
        elif g == SETS["buckets"] and bucket is not None:
            tally.add_buckets([(bucket, n)])
        elif g == SETS["totals"]:
            seen, unreadable, in_scope = total, bad, scoped
            spans = [x for x in (lo, hi) if x is not None]
    tally.rows_read = seen
    tally.covered = in_scope > 0
    if spans:
        tally.span = (min(spans), max(spans))
    if not tally.covered:
        tally.notes.append("the logs hold no request to this node in the window")
    if unreadable:
        tally.notes.append(f"{unreadable} line(s) were no log record of their format and were skipped")
    if any(fmt == "sglang" for fmt, _ in files.groups):
        tally.notes.append(
            "SGLang's log cuts prompts past 2,048 characters (those are sized by the engine's own count) "
            "and names no key (the monitor's own probes are counted as callers)"
        )


class GatewayLogs:
    """A gateway's log files, every configured glob with its format (a ``BlastSource``).

    Trusted most: a log names every request the gateway served, with its id and its exact time.
    ``threads`` is what DuckDB may use for one scan (the CLI gives it two, the service one).
    """

    name = "gateway logs"
    about = "a gateway's log files (JSON lines or Parquet), read in place by DuckDB"
    trust = 3

    def __init__(self, globs: Sequence[LogSource], threads: int = 1):
        self.globs = list(globs)
        self.threads = threads

    def __repr__(self) -> str:
        return f"GatewayLogs({self.globs!r}, threads={self.threads})"

    def tally(self, session: Session | None, scope: Scope) -> Tally:
        """Count the matching requests in the files (no database is read: ``session`` is unused)."""
        tally = logs_tally(self.globs, scope, self.threads)
        tally.source = self
        return tally

    def requests(self, session: Session | None, scope: Scope, limit: int) -> list[RequestRow]:
        return logs_requests(self.globs, scope, limit, self.threads)
