"""Paging through a real Alertmanager (the Debian package, started on a free loopback port).

Incidents are opened and resolved through the recording path the runner uses (``record``), on
SQLite and PostgreSQL; the :class:`Pager` drains the outbox into Alertmanager, and the tests read
back what Alertmanager holds (``GET /api/v2/alerts``) and what the outbox rows say.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.api.runbooks import RUNBOOKS_DIR
from kvcanary.monitor.config.settings import Settings, parse_settings
from kvcanary.monitor.incidents import confirm, dismiss
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.paging.links import link_signature
from kvcanary.monitor.paging.pager import ALERTNAMES, Delivery, Pager
from kvcanary.monitor.storage import outbox
from kvcanary.monitor.storage.models import IncidentEvent
from tests.support.loopback import Loopback
from tests.support.monitor_db import minutes, record
from tests.support.services import Alertmanager, start_alertmanager

Factory = sessionmaker[Session]
PUBLIC = "http://kvcanary.test:8600"
pytestmark = pytest.mark.external_service


#: The API token of the monitor under test: it signs each alert's link to its incident page.
LINK_KEY = "kvc-test-token-0123456789abcdef"


def settings_for(*urls: str) -> Settings:
    alerting = {"resend_interval_seconds": 30}
    return parse_settings({"alertmanagers": list(urls), "api": {"public_url": PUBLIC}, "alerting": alerting})


def pager_for(factory: Factory, *urls: str) -> tuple[Pager, MonitorMetrics]:
    settings = settings_for(*urls)
    metrics = MonitorMetrics(CollectorRegistry())
    headers = {url: {} for url in urls}
    return Pager(settings, factory, Delivery(headers, metrics, timeout=5), link_key=LINK_KEY), metrics


def drain(pager: Pager) -> int:
    async def go() -> int:
        try:
            return await pager.drain()
        finally:
            await pager.delivery.aclose()
            pager.delivery = Delivery(pager.delivery.headers, pager.delivery.metrics, timeout=5)

    return asyncio.run(go())


def deliveries(metrics: MonitorMetrics, url: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvcanary_alert_deliveries_total", {"alertmanager": url, "outcome": outcome}
    )
    return value or 0.0


def events(factory: Factory) -> list[IncidentEvent]:
    with factory() as s:
        return list(s.scalars(select(IncidentEvent).order_by(IncidentEvent.id)))


def test_a_leak_becomes_an_alert_with_its_figures_and_links(
    session_factory: Factory, alertmanager: Alertmanager
) -> None:
    opened = record(session_factory, "leak", at=minutes(0), detail="1 live marker(s) came back")
    pager, metrics = pager_for(session_factory, alertmanager.url)
    assert drain(pager) == 1
    (alert,) = alertmanager.alerts(alertname="KVCanaryLeak")
    assert alert["labels"] == {
        "alertname": "KVCanaryLeak", "target": "glm-prod", "probe": "cross_tenant", "severity": "critical",
        "certainty": "certain",
    }  # fmt: skip
    notes = alert["annotations"]
    signature = link_signature(LINK_KEY, opened.incident_id, minutes(0) + timedelta(seconds=1))
    assert notes["incident_url"] == f"{PUBLIC}/incidents/{opened.incident_id}?sig={signature}"
    assert notes["runbook_url"] == f"{PUBLIC}/runbooks/KVCanaryLeak"
    assert "1 live marker(s) came back" in notes["description"]
    assert alert["generatorURL"] == notes["incident_url"]
    assert alert["status"]["state"] == "active"
    (event,) = events(session_factory)
    assert event.processed_at is not None and event.attempts == 1
    assert deliveries(metrics, alertmanager.url, "accepted") == 1


def test_a_leak_alert_describes_the_leak_though_a_mismatch_came_after_it(
    session_factory: Factory, alertmanager: Alertmanager
) -> None:
    """A critical incident's latest failure may be a mismatch (a boundary run whose stale pages held
    no marker this time): the page must still say which markers crossed."""
    opened = record(session_factory, "leak", at=minutes(0), detail="1 live marker(s) came back")
    later = record(session_factory, "mismatch", at=minutes(1), detail="HTTP 200 over capacity")
    assert later.incident_id == opened.incident_id
    pager, _ = pager_for(session_factory, alertmanager.url)
    assert drain(pager) >= 1
    (alert,) = alertmanager.alerts(alertname="KVCanaryLeak")
    assert "1 live marker(s) came back" in alert["annotations"]["description"]
    assert alert["annotations"]["description"].startswith("leak on ")


def test_a_resolved_incident_ends_its_alert(session_factory: Factory, alertmanager: Alertmanager) -> None:
    record(session_factory, "mismatch", at=minutes(0), probe="boundary")
    pager, _ = pager_for(session_factory, alertmanager.url)
    drain(pager)
    assert alertmanager.alerts(alertname="KVCanaryMismatch")
    for i in range(1, 4):
        record(session_factory, "pass", at=minutes(i), probe="boundary")
    assert drain(pager) == 1  # the resolved event
    assert alertmanager.alerts(alertname="KVCanaryMismatch") == []  # endsAt passed: dropped


def test_an_escalation_fires_the_new_alert_and_ends_the_old(
    session_factory: Factory, alertmanager: Alertmanager
) -> None:
    record(session_factory, "mismatch", at=minutes(0))
    record(session_factory, "leak", at=minutes(1))
    pager, _ = pager_for(session_factory, alertmanager.url)
    assert drain(pager) == 2
    assert alertmanager.alerts(alertname="KVCanaryLeak")
    assert alertmanager.alerts(alertname="KVCanaryMismatch") == []


def test_a_suspected_leak_pages_as_suspected_and_its_proof_moves_the_alert_to_certain(
    session_factory: Factory, alertmanager: Alertmanager
) -> None:
    record(session_factory, "leak", at=minutes(0), probe="traffic_overlap", certainty="suspected")
    pager, _ = pager_for(session_factory, alertmanager.url)
    assert drain(pager) == 1
    (alert,) = alertmanager.alerts(alertname="KVCanaryLeak")
    assert (alert["labels"]["certainty"], alert["labels"]["check"]) == ("suspected", "overlap")
    record(session_factory, "leak", at=minutes(1), probe="traffic_overlap", reason="foreign_marker")
    assert drain(pager) == 1  # the proven event: the certain alert fires, the suspected one ends
    assert [a["labels"]["certainty"] for a in alertmanager.alerts(alertname="KVCanaryLeak")] == ["certain"]


@pytest.mark.parametrize(("act", "left"), [(confirm, ["confirmed"]), (dismiss, [])])
def test_an_operators_word_on_a_suspected_leak_changes_or_ends_its_alert(
    session_factory: Factory, alertmanager: Alertmanager, act: Any, left: list[str]
) -> None:
    opened = record(session_factory, "leak", at=minutes(0), probe="traffic_reworded", certainty="suspected")
    pager, _ = pager_for(session_factory, alertmanager.url)
    drain(pager)
    with session_factory() as s, s.begin():
        act(s, incident_id=opened.incident_id, note="on-call read the records", now=minutes(1))
    assert drain(pager) == 1
    assert [a["labels"]["certainty"] for a in alertmanager.alerts(alertname="KVCanaryLeak")] == left


def test_an_alertmanager_outage_loses_nothing_and_doubles_nothing(
    session_factory: Factory, tmp_path: Path
) -> None:
    am = start_alertmanager(tmp_path / "am")
    port = am.port
    am.stop()
    record(session_factory, "leak", at=minutes(0), target="a")
    record(session_factory, "mismatch", at=minutes(0), target="b")
    pager, metrics = pager_for(session_factory, am.url)
    assert drain(pager) == 0
    tried, untried = events(session_factory)
    assert deliveries(metrics, am.url, "failed") == 1  # stopped at the first: order is kept
    assert tried.processed_at is None and tried.attempts == 1 and tried.last_error
    assert untried.processed_at is None and untried.attempts == 0 and untried.last_error is None
    am = start_alertmanager(tmp_path / "am2", port=port)
    try:
        assert drain(pager) == 2
        assert [a["labels"]["target"] for a in am.alerts(alertname="KVCanaryLeak")] == ["a"]
        assert [a["labels"]["target"] for a in am.alerts(alertname="KVCanaryMismatch")] == ["b"]
        assert drain(pager) == 0  # nothing is delivered twice
        assert deliveries(metrics, am.url, "accepted") == 2
    finally:
        am.stop()


def test_every_alertmanager_is_told_and_one_is_enough(
    session_factory: Factory, alertmanager: Alertmanager, tmp_path: Path
) -> None:
    second = start_alertmanager(tmp_path / "am2")
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    try:
        record(session_factory, "leak", at=minutes(0))
        pager, metrics = pager_for(session_factory, alertmanager.url, second.url, dead)
        assert drain(pager) == 1
        assert alertmanager.alerts(alertname="KVCanaryLeak") and second.alerts(alertname="KVCanaryLeak")
        assert deliveries(metrics, dead, "failed") == 1
    finally:
        second.stop()


def test_two_pagers_draining_one_outbox_deliver_each_event_once(
    db_url: str, session_factory: Factory, alertmanager: Alertmanager
) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("two writers racing need PostgreSQL (SQLite has one writer at a time)")
    for i in range(40):
        record(session_factory, "leak" if i % 2 else "mismatch", at=minutes(i), target=f"t{i}")
    pagers = [pager_for(session_factory, alertmanager.url) for _ in range(2)]
    counts: list[int] = []
    threads = [threading.Thread(target=lambda p=p: counts.append(drain(p[0]))) for p in pagers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(counts) == 40
    assert sum(deliveries(m, alertmanager.url, "accepted") for _, m in pagers) == 40
    assert all(e.processed_at is not None and e.attempts == 1 for e in events(session_factory))


def test_open_incidents_are_resent_with_their_end_ahead(
    session_factory: Factory, alertmanager: Alertmanager
) -> None:
    record(session_factory, "leak", at=minutes(0))
    pager, metrics = pager_for(session_factory, alertmanager.url)

    async def go() -> tuple[bool, bool]:
        try:
            return await pager.resend_if_due(), await pager.resend_if_due()
        finally:
            await pager.delivery.aclose()

    assert asyncio.run(go()) == (True, False)  # the second waits for the interval
    (alert,) = alertmanager.alerts(alertname="KVCanaryLeak")
    assert alert["endsAt"] > alert["startsAt"]
    assert deliveries(metrics, alertmanager.url, "accepted") == 1


def test_an_alert_every_alertmanager_refuses_for_good_does_not_block_the_outbox(
    session_factory: Factory,
) -> None:
    """A malformed alert (400 from all) is set aside with its reason; the next event goes on."""
    posted: list[Any] = []

    def refuse_first(request: httpx.Request) -> httpx.Response:
        posted.append(request)
        return httpx.Response(400 if len(posted) == 1 else 200, text="bad alert")

    record(session_factory, "leak", at=minutes(0), target="a")
    record(session_factory, "leak", at=minutes(0), target="b")
    settings = settings_for("http://am.test")
    metrics = MonitorMetrics(CollectorRegistry())
    delivery = Delivery({"http://am.test": {}}, metrics, 5, transport=httpx.MockTransport(refuse_first))
    pager = Pager(settings, session_factory, delivery)
    assert asyncio.run(pager.drain()) == 2
    first, second = events(session_factory)
    assert first.processed_at is not None and first.last_error and "refused" in first.last_error
    assert second.processed_at is not None and second.last_error is None


def test_a_wrong_path_or_a_proxy_answering_404_holds_the_alert_back_for_a_retry(
    session_factory: Factory,
) -> None:
    """404 and 405 say the address is wrong (a path prefix, a proxy mid-deploy), not the alert."""
    status = {"code": 404}
    delivery = Delivery(
        {"http://am.test": {}}, MonitorMetrics(CollectorRegistry()), 5,
        transport=httpx.MockTransport(lambda request: httpx.Response(status["code"], text="no such path")),
    )  # fmt: skip
    record(session_factory, "leak", at=minutes(0))
    pager = Pager(settings_for("http://am.test"), session_factory, delivery)
    assert asyncio.run(pager.drain()) == 0
    (event,) = events(session_factory)
    assert event.processed_at is None and event.attempts == 1 and "404" in (event.last_error or "")
    status["code"] = 200  # the proxy is back: the same event goes out
    assert asyncio.run(pager.drain()) == 1


def test_slow_alertmanagers_never_outlast_a_claim(session_factory: Factory) -> None:
    """Posting a claimed batch stops at half the lease and hands the rest back: a claim that lapsed
    mid-batch would let another pager send the same events again, and out of order."""
    lease = 4.0  # a post is cut off at 2 s and ends by 3: a second's slack for a loaded machine
    claimed_at: list[float] = []
    held: list[float] = []  # for each post, how long the claim holding it had run when it ended

    class Timed(Pager):
        def _claim(self) -> list:  # type: ignore[type-arg]
            claimed_at.append(time.monotonic())
            return super()._claim()

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(1.0)  # six of these outlast the lease: the batch must be cut at half of it
        held.append(time.monotonic() - claimed_at[-1])
        return httpx.Response(200)

    for name in "abcdef":
        record(session_factory, "leak", at=minutes(0), target=name)
    delivery = Delivery({"http://am.test": {}}, MonitorMetrics(CollectorRegistry()), 5,
                        transport=httpx.MockTransport(slow))  # fmt: skip
    pager = Timed(settings_for("http://am.test"), session_factory, delivery, lease_seconds=lease)
    assert asyncio.run(pager.drain()) == 6
    assert len(held) == 6 and max(held) < lease, held  # every event sent once, within its claim
    assert all(e.processed_at is not None and e.attempts == 1 for e in events(session_factory))


def test_a_relapse_is_never_resent_as_resolved(session_factory: Factory, alertmanager: Alertmanager) -> None:
    """Alertmanager knows an alert by its labels: the resolved alert of the incident before a relapse
    must not be re-sent beside the new one, or it could turn the live page into a false "resolved"."""
    start = datetime.now(UTC) - timedelta(minutes=5)
    first = record(session_factory, "leak", at=start)
    for i in (1, 2, 3):
        record(session_factory, "pass", at=start + timedelta(minutes=i))
    relapse = record(session_factory, "leak", at=start + timedelta(minutes=4))
    assert relapse.incident_id != first.incident_id
    with session_factory() as s:
        resent = outbox.alerting_incidents(s, now=datetime.now(UTC), resolved_within_seconds=600)
    assert [i.id for i in resent] == [relapse.incident_id]
    pager, _ = pager_for(session_factory, alertmanager.url)

    async def go() -> bool:
        try:
            return await pager.resend_if_due()
        finally:
            await pager.delivery.aclose()

    assert asyncio.run(go())
    (alert,) = alertmanager.alerts(alertname="KVCanaryLeak")
    assert alert["status"]["state"] == "active"


def test_every_pushed_alert_has_a_runbook_the_monitor_serves() -> None:
    for name in ALERTNAMES.values():
        assert (RUNBOOKS_DIR / f"{name}.md").is_file(), name


def test_a_failing_alertmanager_is_retried_with_a_bounded_jittered_backoff(session_factory: Factory) -> None:
    """On main one event was posted 40 times in 30 s to an Alertmanager answering 503."""
    posts: list[float] = []
    healthy_after = 14.0

    def alertmanager(request: httpx.Request) -> httpx.Response:
        posts.append(time.monotonic())
        return httpx.Response(200 if time.monotonic() - started > healthy_after else 503, json={})

    started = time.monotonic()
    server = Loopback(alertmanager)
    record(session_factory, "leak", at=minutes(0), target="a")
    settings = parse_settings(
        {
            "alertmanagers": [server.url],
            "api": {"public_url": PUBLIC},
            "alerting": {
                "resend_interval_seconds": 1,
                "poll_interval_seconds": 0.5,
                "backoff_max_seconds": 4,
            },
        }
    )
    metrics = MonitorMetrics(CollectorRegistry())
    pager = Pager(
        settings, session_factory, Delivery({server.url: {}}, metrics, timeout=5), link_key=LINK_KEY
    )
    seen: list[float] = []

    async def run() -> None:
        task = asyncio.create_task(pager.run_forever())
        for _ in range(40):  # nudges (new incidents) must not cut a backoff short
            pager.nudge()
            await asyncio.sleep(0.25)
            seen.append(metrics.registry.get_sample_value("kvcanary_alert_delivery_backoff_seconds") or 0)
        await asyncio.sleep(healthy_after + 4 - 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pager.delivery.aclose()

    try:
        asyncio.run(run())
    finally:
        server.close()
    failing = [t - started for t in posts if t - started <= healthy_after]
    # A round posts the event, then re-sends the open alerts; rounds are at least half a second apart
    # (the shortest backoff jittered down to half), so posts closer than 0.4 s are one round.
    rounds = [t for i, t in enumerate(failing) if i == 0 or t - failing[i - 1] > 0.4]
    gaps = [b - a for a, b in itertools.pairwise(rounds)]
    assert len(rounds) <= 8, rounds  # 1, 2, 4, 4, 4 s apart at most, jittered down to half
    assert max(gaps) <= 4.5 and max(seen) <= 4 and max(seen) > 1  # bounded, and said on /metrics
    assert min(gaps[-3:]) < 3.9  # jittered: capped waits are drawn between 2 and 4 s, not all 4
    assert events(session_factory)[0].processed_at is not None  # delivered once it answered
    assert metrics.registry.get_sample_value("kvcanary_alert_delivery_failures") == 0


def test_a_stop_that_lands_with_a_nudge_still_stops_the_pager(session_factory: Factory) -> None:
    """A nudge (an incident changed) and the stop in one loop iteration: on Python 3.11,
    ``asyncio.wait_for`` returns the wake-up it was waiting for and drops the cancellation
    (CPython gh-86296), and the pager paged on for ever while ``kvcanary serve`` waited to stop."""
    server = Loopback(lambda request: httpx.Response(200, json={}))
    pager, _ = pager_for(session_factory, server.url)

    async def go() -> bool:
        task = asyncio.create_task(pager.run_forever())
        for _ in range(100):  # until a round is done (nothing to send) and it waits for a nudge
            await asyncio.sleep(0.05)
            if pager._wake._waiters:  # type: ignore[attr-defined]  # asyncio.Event's own waiters
                break
        pager.nudge()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=3)
        if not done:
            task.cancel()  # once more, so the loop is not left running under the next test
        await pager.delivery.aclose()
        return task in done and task.cancelled()

    try:
        assert asyncio.run(go()), "the pager ran on past its cancellation"
    finally:
        server.close()
