"""The incident page an alert links to: opened by its signed link, readable, and never a copy of
what a target answered. Over a real database; the link comes from a real Alertmanager."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.incidents import confirm, record_result
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.paging.links import incident_url, link_signature
from kvcanary.monitor.paging.pager import Delivery, Pager
from kvcanary.monitor.storage.models import Incident
from kvcanary.probes.base import ProbeResult, Verdict
from tests.monitor.paging.test_pager import LINK_KEY, drain, pager_for, settings_for
from tests.support.monitor_app import build_app, settings_with_targets
from tests.support.monitor_db import POLICY, RETENTION, minutes, record
from tests.support.services import Alertmanager

Factory = sessionmaker[Session]
CUSTOMER_TEXT = "Dear Dr. Okafor, the biopsy results"


def signed(factory: Factory, incident_id: int, key: str = LINK_KEY) -> dict[str, str]:
    """Return the query of the link an alert would carry for this incident."""
    with factory() as s:
        opened_at = s.scalar(select(Incident.opened_at).where(Incident.id == incident_id))
    assert opened_at is not None
    return {"sig": link_signature(key, incident_id, opened_at)}


def page_app(factory: Factory, token: str | None = LINK_KEY) -> FastAPI:
    return build_app(factory, settings=settings_with_targets(), token=token)


@pytest.fixture
def client(session_factory: Factory) -> Iterator[TestClient]:
    with TestClient(page_app(session_factory)) as c:
        yield c


def leak_with_an_excerpt(factory: Factory) -> int:
    """Record a leak whose evidence holds a redacted excerpt of another customer's text."""
    evidence = {
        "leaks": [{"marker_id": "0badc0de", "owner_tenant": "alice", "reader_tenant": "bob",
                   "marker_sha256": "ab" * 32, "excerpt": f"...{CUSTOMER_TEXT} KVC-0badc0de-<redacted>"}],
        "leak_count": 1,
    }  # fmt: skip
    result = ProbeResult(
        Verdict.LEAK, "foreign_marker", "1 live marker(s) of tenant(s) alice came back <b>once</b>", evidence
    )
    with factory() as s, s.begin():
        outcome = record_result(
            s, target_name="glm-prod", engine="sglang", base_url="http://127.0.0.1:30000/v1", model="glm-5.3",
            probe="cross_tenant", result=result, started_at=minutes(0), duration_seconds=0.5, policy=POLICY,
            retention=RETENTION, now=minutes(0),
        )  # fmt: skip
    assert outcome.incident_id is not None
    return outcome.incident_id


def test_a_signed_link_opens_the_page_with_the_timeline_and_the_evidence(
    client: TestClient, session_factory: Factory
) -> None:
    incident = leak_with_an_excerpt(session_factory)
    record(session_factory, "pass", at=minutes(1))
    page = client.get(f"/incidents/{incident}", params=signed(session_factory, incident))
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    html = page.text
    for expected in (
        "critical",
        "open",
        "glm-prod / cross_tenant",
        "Timeline",
        "opened",
        "0badc0de",
        "alice",
    ):
        assert expected in html, expected
    assert "/runbooks/KVCanaryLeak" in html
    # Nothing the monitor did not write itself is served as markup.
    assert "&lt;b&gt;once&lt;/b&gt;" in html and "<b>once</b>" not in html
    assert page.headers["cache-control"] == "no-store"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert "script-src" not in page.headers["content-security-policy"]
    assert "<script" not in html


def test_a_leak_down_a_path_names_its_prefill_and_decode_nodes(
    client: TestClient, session_factory: Factory
) -> None:
    pair = {"prefill": "prefill-10.0.0.7-30000", "decode": "decode-10.0.0.9-30000.dp1"}
    result = ProbeResult(Verdict.LEAK, "foreign_marker", "a marker of alice came back", {"path": pair})
    with session_factory() as s, s.begin():
        outcome = record_result(
            s, target_name="glm-prod", engine="sglang", base_url="http://127.0.0.1:30000/v1", model="glm-5.3",
            probe="canary", result=result, started_at=minutes(0), duration_seconds=0.5, policy=POLICY,
            retention=RETENTION, now=minutes(0), node=f"{pair['prefill']}--{pair['decode']}",
        )  # fmt: skip
    incident = outcome.incident_id
    assert incident is not None
    page = client.get(f"/incidents/{incident}", params=signed(session_factory, incident))
    assert page.status_code == 200, page.text
    where = (
        "glm-prod / canary · down prefill prefill-10.0.0.7-30000 → decode decode-10.0.0.9-30000.dp1 "
        "(prefill-10.0.0.7-30000--decode-10.0.0.9-30000.dp1)"
    )
    assert where in page.text, page.text[:2000]


def test_a_suspected_leak_says_so_links_its_runbook_and_shows_the_operators_word(
    client: TestClient, session_factory: Factory
) -> None:
    opened = record(session_factory, "leak", at=minutes(0), probe="traffic_overlap", certainty="suspected")
    incident = opened.incident_id
    assert incident is not None
    page = client.get(f"/incidents/{incident}", params=signed(session_factory, incident)).text
    assert '<span class="badge suspected">suspected</span>' in page
    assert "Suspected, not proven" in page and f"/api/v1/incidents/{incident}/confirm" in page
    assert "/runbooks/KVCanaryLeakSuspected" in page
    with session_factory() as s, s.begin():
        confirm(s, incident_id=incident, note="a contract draft <not> public", now=minutes(1))
    page = client.get(f"/incidents/{incident}", params=signed(session_factory, incident)).text
    assert '<span class="badge confirmed">confirmed</span>' in page
    assert "a contract draft &lt;not&gt; public" in page and '/runbooks/KVCanaryLeak"' in page


def test_the_page_never_shows_what_a_target_answered(client: TestClient, session_factory: Factory) -> None:
    incident = leak_with_an_excerpt(session_factory)
    html = client.get(f"/incidents/{incident}", params=signed(session_factory, incident)).text
    assert CUSTOMER_TEXT not in html
    assert "left out of this page" in html
    # The REST API, behind the bearer token, still has it.
    detail = client.get(f"/api/v1/incidents/{incident}", headers={"Authorization": f"Bearer {LINK_KEY}"})
    assert CUSTOMER_TEXT in detail.text


def test_a_row_stored_with_control_and_bidi_characters_reaches_the_page_without_them(
    client: TestClient, session_factory: Factory
) -> None:
    # A row written before names were made printable where they enter: the page is the last guard.
    incident = leak_with_an_excerpt(session_factory)
    forged = "caller\u202etxt.exe\x1b[2K\u200b\x85 [FAKE] resolved"
    with session_factory() as s, s.begin():
        row = s.get(Incident, incident)
        assert row is not None
        row.title = forged
    html = client.get(f"/incidents/{incident}", params=signed(session_factory, incident)).text
    assert "[FAKE] resolved" in html  # the text stays, shown for what it is
    assert not any(c in html for c in "\u202e\x1b\u200b\x85"), "a control or bidi character reached the page"


def test_only_a_link_signed_for_this_incident_or_the_token_opens_it(
    client: TestClient, session_factory: Factory
) -> None:
    incident = leak_with_an_excerpt(session_factory)
    other = record(session_factory, "mismatch", at=minutes(5), probe="boundary").incident_id
    assert other is not None
    refused = [
        {},
        {"sig": "0" * 32},
        signed(session_factory, other),  # another incident's link
        signed(session_factory, incident, "another-monitors-token-000000"),
    ]
    for params in refused:
        assert client.get(f"/incidents/{incident}", params=params).status_code == 403, params
    bearer = {"Authorization": f"Bearer {LINK_KEY}"}
    assert client.get(f"/incidents/{incident}", headers=bearer).status_code == 200
    assert client.get(f"/incidents/{incident}", headers={"Authorization": "Bearer wrong"}).status_code == 403
    # An incident that does not exist is refused like any other link: nothing to learn from it.
    unknown = {"sig": link_signature(LINK_KEY, 999_999, minutes(0))}
    assert client.get("/incidents/999999", params=unknown).status_code == 403
    # A database rebuilt under the same token reuses ids: an old link must not open the new incident.
    reused = {"sig": link_signature(LINK_KEY, incident, minutes(-60))}
    assert client.get(f"/incidents/{incident}", params=reused).status_code == 403
    assert client.get("/incidents/0").status_code == 422


def test_a_local_api_without_a_token_serves_plain_links(session_factory: Factory) -> None:
    incident = leak_with_an_excerpt(session_factory)
    plain = incident_url("http://127.0.0.1:9108", incident, minutes(0), None)
    assert plain == f"http://127.0.0.1:9108/incidents/{incident}"
    with TestClient(page_app(session_factory, token=None)) as c:
        assert c.get(f"/incidents/{incident}").status_code == 200


def test_the_link_in_the_alert_alertmanager_holds_opens_the_page(
    session_factory: Factory,
    alertmanager: Alertmanager,
) -> None:
    incident = leak_with_an_excerpt(session_factory)
    pager, _ = pager_for(session_factory, alertmanager.url)
    assert drain(pager) == 1
    (alert,) = alertmanager.alerts(alertname="KVCanaryLeak")
    link = urlsplit(alert["annotations"]["incident_url"])
    assert link.path == f"/incidents/{incident}"
    with TestClient(page_app(session_factory)) as browser:  # no bearer token: the link is the credential
        page = browser.get(f"{link.path}?{link.query}")
    assert page.status_code == 200 and "KVCanaryLeak" in page.text


def test_the_timeline_says_when_no_alertmanager_took_an_event(
    client: TestClient, session_factory: Factory
) -> None:
    """An event every Alertmanager refused for good is set aside: the page must not say it was paged."""
    incident = leak_with_an_excerpt(session_factory)
    refusing = httpx.MockTransport(lambda request: httpx.Response(400, text="bad alert"))
    delivery = Delivery({"http://am.test": {}}, MonitorMetrics(CollectorRegistry()), 5, transport=refusing)
    pager = Pager(settings_for("http://am.test"), session_factory, delivery, link_key=LINK_KEY)
    assert asyncio.run(pager.drain()) == 1  # done with, not delivered
    html = client.get(f"/incidents/{incident}", params=signed(session_factory, incident)).text
    assert "never: refused" in html and "bad alert" in html


def test_a_refusal_reads_the_same_whether_the_incident_exists_or_not(
    client: TestClient, session_factory: Factory
) -> None:
    """Loading the incident before checking the link let a stranger count incidents by timing (a
    missing id answered in 1.7 ms, an existing one in 2.9-3.2 ms): a refusal must read no more."""
    incident = leak_with_an_excerpt(session_factory)
    statements: list[str] = []

    def note(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(" ".join(statement.split()))

    engine = session_factory.kw["bind"]
    event.listen(engine, "before_cursor_execute", note)
    try:
        reads = {}
        for incident_id in (incident, 999_999):
            statements.clear()
            assert client.get(f"/incidents/{incident_id}", params={"sig": "0" * 32}).status_code == 403
            reads[incident_id] = list(statements)  # bound parameters: the id is not in the text
        statements.clear()
        link = signed(session_factory, incident)
        assert client.get(f"/incidents/{incident}", params=link).status_code == 200
        opened = len(statements)
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert reads[incident] == reads[999_999]
    selects = [s for s in reads[incident] if s.startswith("SELECT")]
    assert len(selects) == 1 and "FROM incident WHERE" in selects[0]
    assert opened > len(reads[incident])  # the page itself reads the timeline and the results
