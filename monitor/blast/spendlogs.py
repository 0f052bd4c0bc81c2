"""LiteLLM's ``LiteLLM_SpendLogs`` table (its database mode): one row per request it served.

Read with one grouped statement over the ``startTime`` index. The request id is the row's: the
response's id, which LiteLLM's logging payload and the tap also call ``id``; the caller is named as
the tap names it (team, key alias, key hash, end user); ``api_key`` is the key's SHA-256, which
is how the monitor's own tenants are known. A prompt's size comes from the stored request body
(``proxy_server_request.messages``), which LiteLLM keeps only with
``general_settings.store_prompts_in_spend_logs: true``; without it a request is sized by its
reported count, which is what an over-capacity defect falsifies, and the tally says so.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session

from kvcanary.monitor.blast.logs import SETS, match_sql
from kvcanary.monitor.blast.question import Scope
from kvcanary.monitor.blast.source import RequestRow, Tally
from kvcanary.monitor.routing import api_base_key_sql, routed_keys

TABLE = '"LiteLLM_SpendLogs"'

_MESSAGES = """(SELECT sum(CASE jsonb_typeof(m->'content')
        WHEN 'string' THEN length(m->>'content')
        WHEN 'array' THEN (SELECT coalesce(sum(length(p->>'text')), 0)
                             FROM jsonb_array_elements(m->'content') p)
        ELSE 0 END)
   FROM jsonb_array_elements(CASE WHEN jsonb_typeof(s.proxy_server_request->'messages') = 'array'
                                  THEN s.proxy_server_request->'messages' ELSE '[]'::jsonb END) m)"""

#: ``api_key`` as a key hash: a SHA-256 as it is, anything else (a key LiteLLM kept raw) as its
#: SHA-256, never as it is (``log_formats._digest``).
_DIGEST = """(CASE WHEN s.api_key ~ '^[0-9a-f]{64}$' THEN s.api_key
       WHEN coalesce(s.api_key, '') = '' THEN NULL
       ELSE encode(sha256(convert_to(s.api_key, 'UTF8')), 'hex') END)"""

_NORMAL = f"""SELECT s.request_id,
        coalesce(nullif(s.team_id, ''), nullif(s.metadata->>'user_api_key_alias', ''), {_DIGEST},
                 nullif(s.end_user, ''), '') AS caller,
        coalesce({_DIGEST} = ANY(:own), false) AS own,
        extract(epoch FROM s."startTime") AS t,
        coalesce(s.status, 'success') = 'success' AS ok,
        {api_base_key_sql("coalesce(s.api_base, '')")} = ANY(:bases) AS routed,
        s.prompt_tokens,
        CASE WHEN jsonb_typeof(s.proxy_server_request->'messages') = 'array' THEN {_MESSAGES} END
          AS prompt_chars
   FROM {TABLE} s
  WHERE s."startTime" BETWEEN (to_timestamp(:start) AT TIME ZONE 'UTC')
                          AND (to_timestamp(:end) AT TIME ZONE 'UTC')"""


#: The first and last request the table holds at all (two ends of the ``startTime`` index).
_HELD = f'SELECT extract(epoch FROM min("startTime")), extract(epoch FROM max("startTime")) FROM {TABLE}'


def public(url: str) -> str:
    """Return what a report may show of a database URL: its scheme, host, port and database name.

    Nothing else: not the user or password, and no query or fragment, since libpq takes secrets
    there too (``?password=``, ``?sslpassword=``, ``?sslkey=``). Raise ``ArgumentError`` (or
    ``ValueError``) where ``url`` is no database URL.
    """
    parsed = make_url(url)
    # SQLAlchemy keeps what follows a second "@" in the host, and a "#..." in the database name.
    host = (parsed.host or "").rpartition("@")[2] or None
    database = (parsed.database or "").partition("#")[0] or None
    shown = URL.create(parsed.drivername, host=host, port=parsed.port, database=database)
    return shown.render_as_string(hide_password=False)


def spendlogs_engine(url: str) -> Engine:
    """An engine on LiteLLM's database: its ``postgresql://`` (or ``postgres://``) URL is read with
    psycopg, as the monitor's own is; anything else is refused with a ValueError."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            url = "postgresql+psycopg://" + url.removeprefix(scheme)
    if not url.startswith("postgresql+psycopg://"):
        raise ValueError("LiteLLM's database must be a postgresql:// URL")
    return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 10})


def _match(scope: Scope) -> str:
    return match_sql(scope, "routed")


def _params(scope: Scope) -> dict[str, Any]:
    return {
        "start": scope.start_epoch,
        "end": scope.end_epoch,
        # Never an empty array: PostgreSQL cannot type one. No key hash or base is "-".
        "own": sorted(scope.own_keys) or ["-"],
        "bases": routed_keys(scope.api_bases) or ["-"],
        "width": scope.bucket_seconds,
        "exclude": list(scope.exclude),
    }


def spendlogs_tally(url: str, scope: Scope) -> Tally:
    try:
        where = f"{TABLE} at {public(url)}"
    except (ArgumentError, ValueError):
        where = f"{TABLE} (the URL given is not a database URL)"
    tally = Tally(SpendLogs.name, where)
    if scope.criterion.kind in ("flagged", "none"):
        tally.notes.append(
            "LiteLLM's spend log holds no check's verdict: only the recorded traffic answers this criterion"
        )
        return tally
    # One pass, as grouping sets (``monitor/blast/logs.py``'s ``SETS``): callers, buckets, totals.
    grouped = f"""SELECT GROUPING(c, o, b) AS g, c, o, b,
           count(*) FILTER (WHERE m), min(t) FILTER (WHERE m), max(t) FILTER (WHERE m),
           count(*) FILTER (WHERE routed), count(*) FILTER (WHERE routed AND prompt_chars IS NULL)
      FROM (SELECT *, CASE WHEN m THEN caller END AS c, CASE WHEN m THEN own END AS o,
                   CASE WHEN m AND NOT own AND NOT (caller = ANY(CAST(:exclude AS text[])))
                        THEN floor((t - :start) / :width)::bigint END AS b
              FROM (SELECT *, coalesce({_match(scope)}, false) AS m FROM ({_NORMAL}) n) a) f
     GROUP BY GROUPING SETS ((c, o), (b), ())"""
    try:
        engine = spendlogs_engine(url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(text(grouped), _params(scope)).all()
                lo, hi = conn.execute(text(_HELD)).one()
        finally:
            engine.dispose()
    except (SQLAlchemyError, ValueError) as exc:
        cause = getattr(exc, "orig", None) or exc
        tally.notes.append(f"could not read {TABLE}: {type(cause).__name__}")
        return tally
    routed = unsized = 0
    for g, caller, own, bucket, n, first, last, scoped, no_chars in rows:
        if g == SETS["callers"] and n:
            tally.add_callers([(caller, own, n, float(first), float(last))])
        elif g == SETS["buckets"] and bucket is not None:
            tally.add_buckets([(bucket, n)])
        elif g == SETS["totals"]:
            routed, unsized = scoped, no_chars
    tally.rows_read, tally.covered = routed, routed > 0
    tally.span = (float(lo), float(hi)) if lo is not None else None  # what the table holds at all
    if not routed:
        tally.notes.append("the spend log holds no request to this node in the window")
    if unsized and scope.criterion.kind == "over_pool":
        tally.notes.append(
            f"{unsized} row(s) hold no prompt (store_prompts_in_spend_logs is off): sized by the reported "
            "count, which an over-capacity defect falsifies"
        )
    return tally


class SpendLogs:
    """LiteLLM's ``LiteLLM_SpendLogs`` table, read over its URL (a ``BlastSource``).

    The URL holds a password: it is kept private and shown only as ``public`` has it, in the
    tally's ``detail`` and in this object's ``repr``. Trusted below a gateway's logs (a row lacks
    the prompt unless LiteLLM was told to store it) and above the recorded traffic.
    """

    name = "LiteLLM_SpendLogs"
    about = "LiteLLM's spend log table (its database mode): one row per request it served"
    trust = 2

    def __init__(self, url: str):
        self._url = url

    def __repr__(self) -> str:
        try:
            return f"SpendLogs({public(self._url)!r})"
        except (ArgumentError, ValueError):
            return "SpendLogs(<not a database URL>)"

    def tally(self, session: Session | None, scope: Scope) -> Tally:
        """Count the matching rows (the monitor's own database is not read: ``session`` is unused)."""
        tally = spendlogs_tally(self._url, scope)
        tally.source = self
        return tally

    def requests(self, session: Session | None, scope: Scope, limit: int) -> list[RequestRow]:
        """The matching rows' ids; raise ValueError (naming the table, not the URL) when it cannot be read."""
        if scope.criterion.kind in ("flagged", "none"):
            return []
        query = f"SELECT request_id, caller, own, t FROM ({_NORMAL}) n WHERE {_match(scope)}"
        query += f" ORDER BY t LIMIT {int(limit)}"
        engine = spendlogs_engine(self._url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(text(query), _params(scope))
                return [(r, c, bool(o), float(t)) for r, c, o, t in rows]
        except SQLAlchemyError as exc:
            cause = getattr(exc, "orig", None) or exc
            raise ValueError(f"could not read {TABLE}: {type(cause).__name__}") from None
        finally:
            engine.dispose()
