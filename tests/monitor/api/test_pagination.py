"""Keyset pagination of the REST lists, on SQLite and PostgreSQL: every row once and in order, under
concurrent inserts and with filters; cursors that are not ours are 422; offsets are capped; and
the list queries read an index in order instead of sorting the table."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, insert, text
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.deps import MAX_OFFSET
from kvcanary.monitor.storage import queries
from kvcanary.monitor.storage.db import utcnow
from kvcanary.monitor.storage.models import ProbeResultRow, Target
from tests.support.monitor_app import build_app, settings_with_targets
from tests.support.monitor_db import T0, minutes, record

Factory = sessionmaker[Session]
RESULTS = "/api/v1/probe-results"
TARGETS = ("glm-prod", "llama-dev", "qwen-canary")
PROBES = ("canary", "cross_tenant", "boundary")


@pytest.fixture
def client(session_factory: Factory) -> Iterator[TestClient]:
    with TestClient(build_app(session_factory, settings=settings_with_targets(), token=None)) as c:
        yield c


def add_results(
    factory: Factory,
    n: int,
    *,
    start: int = 0,
    at: Callable[[int], datetime] | None = None,
    targets: tuple[str, ...] = TARGETS,
) -> None:
    """Insert ``n`` results straight into the table (no incident rules), numbered from ``start``.

    Every fourth row shares its ``started_at`` with the row before it (ties broken by id); targets,
    probes and nodes rotate; one row in 25 is a leak and one in 10 is on node ``prefill-0``.
    """
    when = at or (lambda i: T0 + timedelta(seconds=i - i % 4 // 3))
    with factory() as s, s.begin():
        ids = {name: _target_id(s, name) for name in targets}
        rows = [
            {
                "target_id": ids[targets[i % len(targets)]],
                "probe": PROBES[i // 3 % 3],
                "node": "prefill-0" if i % 10 == 7 else "",
                "verdict": "leak" if i % 25 == 11 else "pass",
                "reason": "r",
                "detail": f"row {i}",
                "started_at": when(i),
                "duration_seconds": 0.1,
                "evidence": {},
                "expires_at": when(i) + timedelta(days=7),
            }
            for i in range(start, start + n)
        ]
        s.execute(insert(ProbeResultRow), rows)


def _target_id(session: Session, name: str) -> int:
    found = session.execute(text("SELECT id FROM target WHERE name = :n"), {"n": name}).scalar()
    if found is not None:
        return int(found)
    target = Target(name=name, engine="sglang", base_url="http://h", model="m", created_at=T0, updated_at=T0)
    session.add(target)
    session.flush()
    return target.id


def expected(factory: Factory, **filters: Any) -> list[int]:
    """Return the ids matching ``filters`` (column = value), newest first, straight from the table."""
    where = " AND ".join(f"{column} = :{column}" for column in filters) or "1 = 1"
    query = f"SELECT id FROM probe_result WHERE {where} ORDER BY started_at DESC, id DESC"
    with factory() as s:
        return list(s.execute(text(query), filters).scalars())


def page_through(
    client: TestClient, path: str, between: Callable[[], None] = lambda: None, **params: Any
) -> list[int]:
    """Return the ids of every page, following next_cursor; call ``between`` after each page."""
    ids: list[int] = []
    cursor = None
    while True:
        body = client.get(path, params={**params, **({"cursor": cursor} if cursor else {})}).json()
        ids += [item["id"] for item in body["items"]]
        cursor = body["next_cursor"]
        between()
        if cursor is None:
            return ids


def test_paging_with_cursors_returns_every_row_once_newest_first(
    client: TestClient, session_factory: Factory
) -> None:
    add_results(session_factory, 47)

    first = client.get(RESULTS, params={"limit": 5}).json()
    ids = page_through(client, RESULTS, limit=5)

    assert set(first) == {"items", "next_cursor", "limit"}, "no total: counting every page was the cost"
    assert ids == expected(session_factory) and len(ids) == 47
    assert page_through(client, RESULTS, limit=47)[-1] == ids[-1]


def test_rows_recorded_while_paging_neither_repeat_nor_push_older_rows_onto_later_pages(
    client: TestClient, session_factory: Factory
) -> None:
    add_results(session_factory, 30)
    before = expected(session_factory)
    with session_factory() as s:
        newest = s.get_one(ProbeResultRow, before[0]).started_at
    batches = iter(range(100, 1000, 100))

    def insert_newer_rows() -> None:
        # Newer rows, and rows that tie with the newest on started_at (a higher id sorts first).
        batch = next(batches)
        add_results(session_factory, 3, start=batch, at=lambda i: utcnow())
        add_results(session_factory, 2, start=batch + 50, at=lambda i: newest)

    ids = page_through(client, RESULTS, between=insert_newer_rows, limit=4)

    assert ids == before


@pytest.mark.parametrize(
    "filters",
    [
        {"verdict": "leak"},
        {"target": "llama-dev"},
        {"target": "llama-dev", "probe": "cross_tenant"},
        {"target": "glm-prod", "verdict": "pass"},
        {"node": "prefill-0"},
        {"probe": "boundary", "verdict": "pass"},
        {"target": "qwen-canary", "probe": "canary", "verdict": "pass"},
    ],
)
def test_filters_combine_with_cursors(
    client: TestClient, session_factory: Factory, filters: dict[str, str]
) -> None:
    add_results(session_factory, 80)
    columns: dict[str, Any] = {k: v for k, v in filters.items() if k != "target"}
    if "target" in filters:
        with session_factory() as s:
            columns["target_id"] = _target_id(s, filters["target"])

    ids = page_through(client, RESULTS, limit=3, **filters)

    assert ids == expected(session_factory, **columns) and ids


def test_a_time_range_combines_with_cursors(client: TestClient, session_factory: Factory) -> None:
    add_results(session_factory, 40)
    since, until = T0 + timedelta(seconds=10), T0 + timedelta(seconds=30)

    ids = page_through(client, RESULTS, limit=4, since=since.isoformat(), until=until.isoformat())

    with session_factory() as s:
        rows = {r.id: r.started_at for r in s.query(ProbeResultRow.id, ProbeResultRow.started_at)}
    assert ids == [i for i in expected(session_factory) if since <= rows[i] < until] and ids


def node_pages(factory: Factory, scan_limit: int) -> list[tuple[list[int], bool]]:
    """Return each page of node=prefill-0 results (limit 2) and whether it had a next key."""
    pages: list[tuple[list[int], bool]] = []
    key = None
    with factory() as s:
        while True:
            page = queries.list_probe_results(s, node="prefill-0", limit=2, after=key, scan_limit=scan_limit)
            pages.append(([row.id for row in page.rows], page.next_key is not None))
            key = page.next_key
            if key is None:
                return pages


def test_filters_no_index_leads_with_give_short_pages_that_still_cover_everything(
    session_factory: Factory,
) -> None:
    # node leads no index: each page reads at most scan_limit rows of the (started_at, id) index,
    # so sparse matches (one row in ten here) come as short pages, even empty ones, with a next key.
    add_results(session_factory, 60)
    matching = expected(session_factory, node="prefill-0")

    sparse, wide = node_pages(session_factory, 5), node_pages(session_factory, 25)

    for pages in (sparse, wide):
        assert [i for ids, _ in pages for i in ids] == matching
    assert ([], True) in sparse, "an empty page that is not the end"
    assert max(len(ids) for ids, _ in wide) == 2 and sparse[-1][1] is False


def test_incidents_page_by_cursor_with_filters(client: TestClient, session_factory: Factory) -> None:
    # Each leak opens an incident and three passes resolve it: eight incidents on two targets.
    for n in range(8):
        target = TARGETS[n % 2]
        record(session_factory, "leak", at=minutes(10 * n), target=target)
        for k in range(1, 4 if n < 6 else 1):
            record(session_factory, "pass", at=minutes(10 * n + k), target=target)

    everything = page_through(client, "/api/v1/incidents", limit=3)
    resolved = page_through(client, "/api/v1/incidents", limit=2, state="resolved", target="glm-prod")
    one_page = client.get("/api/v1/incidents", params={"limit": 3}).json()

    with session_factory() as s:
        glm_resolved = s.execute(
            text(
                "SELECT incident.id FROM incident JOIN target ON target.id = incident.target_id "
                "WHERE name = 'glm-prod' AND state = 'resolved' ORDER BY opened_at DESC, incident.id DESC"
            )
        ).scalars()
        assert resolved == list(glm_resolved) and len(resolved) == 3
    assert len(everything) == 8 and everything == sorted(everything, reverse=True)
    assert one_page["limit"] == 3 and len(one_page["items"]) == 3 and one_page["next_cursor"]


# --- cursors that are not ours, and offsets ----------------------------------------------------------


def _tampered(cursor: str) -> list[str]:
    flipped = cursor[:5] + ("A" if cursor[5] != "A" else "B") + cursor[6:]
    return [flipped, cursor[:-2], cursor + "AAAA", "A" * len(cursor), "not-a-cursor", "A"]


def test_a_tampered_truncated_or_foreign_cursor_is_422_naming_it(
    client: TestClient, session_factory: Factory
) -> None:
    add_results(session_factory, 12)
    passes_cursor = client.get(RESULTS, params={"limit": 1, "verdict": "pass"}).json()["next_cursor"]
    assert passes_cursor

    bad = [({"cursor": c, "verdict": "pass"}, RESULTS) for c in _tampered(passes_cursor)]
    bad += [
        ({"cursor": passes_cursor, "verdict": "leak"}, RESULTS),  # other filters
        ({"cursor": passes_cursor}, RESULTS),  # no filters
        ({"cursor": passes_cursor}, "/api/v1/incidents"),  # another list
        ({"cursor": "%%%"}, RESULTS),
        ({"cursor": "x" * 65}, RESULTS),
    ]
    for params, path in bad:
        response = client.get(path, params=params)
        assert response.status_code == 422, (params, response.text)
        assert ["query", "cursor"] in [err["loc"] for err in response.json()["detail"]], response.json()
    assert client.get(RESULTS, params={"cursor": passes_cursor, "verdict": "pass"}).status_code == 200


def test_offsets_still_work_up_to_the_cap(client: TestClient, session_factory: Factory) -> None:
    add_results(session_factory, 9)
    ids = expected(session_factory)

    page = client.get(RESULTS, params={"limit": 3, "offset": 3}).json()
    at_cap = client.get(RESULTS, params={"offset": MAX_OFFSET})
    over = client.get(RESULTS, params={"offset": MAX_OFFSET + 1})
    both = client.get(RESULTS, params={"offset": 3, "cursor": page["next_cursor"]})

    assert [item["id"] for item in page["items"]] == ids[3:6]
    assert page_through(client, RESULTS, cursor=page["next_cursor"]) == ids[6:], "an offset page hands over"
    assert at_cap.status_code == 200 and at_cap.json()["items"] == []
    for response in (over, both):
        assert response.status_code == 422
        assert ["query", "offset"] in [err["loc"] for err in response.json()["detail"]]


@pytest.mark.parametrize(
    "filters",
    [{}, {"verdict": "pass"}, {"target": "llama-dev", "probe": "canary"}, {"node": "prefill-0"}],
    ids=["unfiltered", "verdict", "target+probe", "node (no index leads)"],
)
def test_an_offset_page_holds_the_rows_after_that_many_matches(
    session_factory: Factory, filters: dict[str, str]
) -> None:
    # Without other filters the offset becomes a key found in the index; with them it is an OFFSET.
    add_results(session_factory, 50)
    with session_factory() as s:
        matching = [r.id for r in queries.list_probe_results(s, limit=500, **filters).rows]
        pages = [
            queries.list_probe_results(s, limit=3, offset=k, **filters) for k in (1, 4, len(matching) - 2)
        ]
        beyond = queries.list_probe_results(s, limit=3, offset=len(matching), **filters)

    assert [[r.id for r in page.rows] for page in pages] == [matching[1:4], matching[4:7], matching[-2:]]
    assert pages[0].next_key is not None and pages[-1].next_key is None
    assert (beyond.rows, beyond.next_key) == ([], None)


def test_the_openapi_document_describes_cursor_pages(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()

    for path, page in ((RESULTS, "ProbeResultPage"), ("/api/v1/incidents", "IncidentPage")):
        operation = doc["paths"][path]["get"]
        params = {p["name"]: p for p in operation["parameters"]}
        assert set(doc["components"]["schemas"][page]["properties"]) == {"items", "next_cursor", "limit"}
        assert {"cursor", "limit", "offset"} <= set(params) and params["offset"].get("deprecated") is True
        assert "next_cursor" in operation["description"] and "cursor" in params["cursor"]["description"]
        assert params["offset"]["schema"]["maximum"] == MAX_OFFSET


# --- the queries read an index in order --------------------------------------------------------------


def captured_statements(engine: Engine, run: Callable[[], object]) -> list[tuple[str, Any]]:
    """Return the (SQL, parameters) that ``run`` sends to ``engine``."""
    sent: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        run()
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    return sent


def plan_of(engine: Engine, statement: str, parameters: Any) -> list[dict[str, Any]]:
    """Return every node of the statement's plan as ``{"type", "relation", "index"}``."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters).all()
            return [{"type": row[3], "relation": None, "index": None} for row in rows]
        (plan,) = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + statement, parameters).scalar_one()
    nodes, todo = [], [plan["Plan"]]
    while todo:
        node = todo.pop()
        nodes.append(
            {
                "type": node["Node Type"],
                "relation": node.get("Relation Name"),
                "index": node.get("Index Name"),
            }
        )
        todo += node.get("Plans", [])
    return nodes


#: The targets of the planner test: with 20, one target's rows are few enough to be worth its index.
MANY = tuple(f"t{i:02d}" for i in range(20))
#: The planner test's rows by database. PostgreSQL costs plans: with 3,000 rows (150 a target, as it
#: estimates a target it cannot see at planning) it once chose a bitmap scan and a sort of a target's
#: rows in a full suite, the two plans' costs within a hair; at 500 a target the ordered index wins.
PLANNER_ROWS = {"sqlite": 3_000, "postgresql": 10_000}
QUERIES: dict[str, tuple[Callable[[Session], object], str]] = {
    "unfiltered": (lambda s: queries.list_probe_results(s), "ix_probe_result_started_id"),
    "cursor": (
        lambda s: queries.list_probe_results(s, after=queries.Key(T0 + timedelta(seconds=900), 10**6)),
        "ix_probe_result_started_id",
    ),
    "verdict": (
        lambda s: queries.list_probe_results(s, verdict="leak"),
        "ix_probe_result_verdict_started_id",
    ),
    "verdict, offset": (
        lambda s: queries.list_probe_results(s, verdict="leak", offset=20),
        "ix_probe_result_verdict_started_id",
    ),
    "target": (
        lambda s: queries.list_probe_results(s, target="llama-dev"),
        "ix_probe_result_target_started_id",
    ),
    "target+probe": (
        lambda s: queries.list_probe_results(s, target="t07", probe="canary", limit=10),
        "ix_probe_result_target_probe_started_id",
    ),
    "last verdicts": (
        lambda s: queries.last_verdicts(s, pairs=[(t, p) for t in MANY for p in PROBES]),
        "ix_probe_result_target_probe_started_id",
    ),
}


@pytest.mark.parametrize("name", list(QUERIES))
def test_the_list_queries_read_an_index_in_order_instead_of_sorting_the_table(
    session_factory: Factory, name: str
) -> None:
    # Rows enough, after ANALYZE, for the planners to prefer a full scan and a sort if the index did
    # not fit. No planner setting is changed.
    engine = session_factory.kw["bind"]
    add_results(session_factory, PLANNER_ROWS[engine.dialect.name], targets=MANY)
    with engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE")
    run, index = QUERIES[name]
    with session_factory() as s:
        statements = captured_statements(engine, lambda: run(s))

    nodes = [node for statement, parameters in statements for node in plan_of(engine, statement, parameters)]
    if engine.dialect.name == "sqlite":
        details = [node["type"] for node in nodes]
        assert any(index in d for d in details), details
        assert not any("TEMP B-TREE" in d or d == "SCAN probe_result" for d in details), details
    else:
        assert any(n["type"].startswith("Index") and n["index"] == index for n in nodes), json.dumps(nodes)
        assert not [n for n in nodes if n["type"] == "Seq Scan" and n["relation"] == "probe_result"], nodes
        assert not [n for n in nodes if n["type"] in ("Sort", "Incremental Sort")], nodes
