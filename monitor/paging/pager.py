"""Page a person: incident changes go to every configured Alertmanager (API v2), exactly once each.

The ``incident_event`` rows are the outbox (``monitor/storage/outbox.py``). The :class:`Pager`
claims the oldest undelivered events by compare-and-set, turns each into alerts, posts them to
**every** Alertmanager (HA peers deduplicate; never load-balance), and marks them delivered only
when at least one accepted. A failure gives the events back untouched and stops the batch, so an
Alertmanager outage loses nothing and delays everything equally: once one answers, the backlog is
delivered in order.

Alerts follow Alertmanager's client contract (``monitoring.md`` §3): an open incident is re-sent
every ``resend_interval_seconds`` with ``endsAt`` four intervals ahead (Prometheus's own rule),
so a monitor that dies lets its alerts expire instead of firing forever; a resolved incident is
sent with ``endsAt`` = when it resolved, and re-sent for a few minutes. An escalation resolves the
alert of the old severity and fires the new one (their names differ). Labels are bounded and
stable: ``alertname``, ``target``, ``probe``, ``severity``, ``certainty`` (``certain``,
``suspected``, ``confirmed``: a receiver may route a suspected leak to a person rather than an
automated runbook), for node-scoped probes ``node``, and for a traffic check's incident ``check``
(the check's name, found in the traffic checks' registry by the incident's kind). A change of
severity or certainty resolves the alert of the old labels and fires the new one.
Descriptions carry figures (tokens sent and reported, pool and window, marker ids), never text a
target returned. Summaries and descriptions are one printable line each (``probes/untrusted.py``'s
``plain``): the names in them come from gateways and their customers, and a newline, control or
bidi character there could forge a line (a fake "resolved") in a receiver that renders them.

While no Alertmanager accepts, rounds back off: the wait doubles from ``poll_interval_seconds`` up
to ``backoff_max_seconds``, each wait drawn between half and all of it (jitter, so replicas and
monitors restarted together do not retry in step), and a new incident does not cut it short. The
first acceptance ends it. ``kvcanary_alert_delivery_backoff_seconds`` says how long the current
wait is, ``kvcanary_alert_delivery_failures`` how many rounds failed in a row.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.paging.links import incident_url, runbook_base
from kvcanary.monitor.storage import outbox
from kvcanary.monitor.storage.outbox import IncidentView, PendingEvent
from kvcanary.monitor.traffic.checks import BY_RESULT_KIND as TRAFFIC_CHECKS
from kvcanary.probes.untrusted import plain

log = logging.getLogger("kvcanary.alerting")

#: The alert each incident severity raises. Prometheus's rules use other names (alerts/README.md).
ALERTNAMES = {"critical": "KVCanaryLeak", "high": "KVCanaryMismatch", "warning": "KVCanaryProbeErrors"}
#: Resolved alerts are re-sent this long after the incident resolved.
RESOLVED_RESEND_SECONDS = 300
#: Characters of an alert's summary and description (Alertmanager receivers truncate far shorter).
SUMMARY_CHARS = 500
DESCRIPTION_CHARS = 2000
#: A claim lapses after this long: a pager that died mid-delivery hands its events on.
LEASE_SECONDS = 60


class Delivery:
    """Posts alert batches to every Alertmanager; says whether any accepted, and counts outcomes."""

    def __init__(
        self,
        headers: dict[str, dict[str, str]],
        metrics: MonitorMetrics,
        timeout: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.headers = headers
        self.metrics = metrics
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport, follow_redirects=False)

    async def post(self, alerts: list[dict[str, Any]]) -> tuple[bool, bool, str]:
        """Return (accepted by one, refused by all for good, why not) after posting to every Alertmanager."""
        outcomes = await asyncio.gather(*(self._post_one(url, alerts) for url in self.headers))
        accepted = any(ok for ok, _, _ in outcomes)
        permanent = bool(outcomes) and all(perm for _, perm, _ in outcomes)
        return accepted, permanent and not accepted, "; ".join(why for ok, _, why in outcomes if not ok)

    async def _post_one(self, url: str, alerts: list[dict[str, Any]]) -> tuple[bool, bool, str]:
        try:
            response = await self._client.post(f"{url}/api/v2/alerts", json=alerts, headers=self.headers[url])
        except httpx.HTTPError as exc:
            self.metrics.alert_deliveries.labels(url, "failed").inc()
            return False, False, f"{url}: {type(exc).__name__}"
        if response.is_success:
            self.metrics.alert_deliveries.labels(url, "accepted").inc()
            return True, False, ""
        outcome = "rejected" if 400 <= response.status_code < 500 else "failed"
        self.metrics.alert_deliveries.labels(url, outcome).inc()
        # A payload an Alertmanager refuses as malformed will be refused forever. Anything else is
        # fixed by someone (auth, rate limits, a wrong path prefix or a proxy mid-deploy answering
        # 404/405): retried, or a whole window of pages and resolutions would be set aside unsent.
        permanent = response.status_code in (400, 422)
        return False, permanent, f"{url}: HTTP {response.status_code} {response.text[:120]}"

    async def aclose(self) -> None:
        await self._client.aclose()


class Pager:
    """Drains the outbox and keeps open incidents' alerts alive. Safe to run in several replicas."""

    def __init__(
        self,
        settings: Settings,
        session_factory: sessionmaker[Session],
        delivery: Delivery,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        link_key: str | None = None,
        lease_seconds: float = LEASE_SECONDS,
    ):
        self.settings = settings
        #: How long a claim on outbox events holds (``LEASE_SECONDS``); a batch stops at half of it.
        self.lease_seconds = lease_seconds
        #: Signs each alert's link to its incident page (the API token; ``monitor/paging/links.py``).
        self.link_key = link_key
        self.session_factory = session_factory
        self.delivery = delivery
        self.clock = clock
        self.claimer = f"{socket.gethostname()[:40]}:{os.getpid()}:{secrets.token_hex(3)}"
        self._wake = asyncio.Event()
        self._last_resend: datetime | None = None
        #: Rounds in a row in which no Alertmanager accepted what was due (0: delivering).
        self.failures = 0
        self._round_failed = False

    def nudge(self) -> None:
        """Ask for a drain now (an incident changed) instead of at the next poll."""
        self._wake.set()

    def resend_now(self) -> None:
        """Re-send every alerting incident now, not at the next interval: what an alert says of an
        incident changed without an event of its own (its target's quarantine)."""
        self._last_resend = None
        self._wake.set()

    async def run_forever(self) -> None:
        """Drain and resend until cancelled; failed rounds back off (module docstring)."""
        while True:
            self._round_failed = False
            try:
                await self.drain()
                # Re-sent even when one event is refused again and again (a 413): the other open
                # incidents' alerts must not expire in Alertmanager behind it. Backoff bounds both.
                await self.resend_if_due()
            except Exception:  # a database or network hiccup must not end paging
                log.exception("alert delivery round failed")
                self._round_failed = True
            wait = self._next_wait()
            self._wake.clear()
            if self.failures:
                await asyncio.sleep(wait)  # a nudge does not shorten a backoff
            else:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that
                # lands with the nudge (CPython gh-86296), and the pager would outlive its stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()

    def _next_wait(self) -> float:
        """Return the wait before the next round: the poll, or a jittered, bounded backoff."""
        alerting = self.settings.alerting
        self.failures = self.failures + 1 if self._round_failed else 0
        wait = alerting.poll_interval_seconds
        if self.failures:
            ceiling = min(alerting.backoff_max_seconds, wait * 2 ** min(self.failures, 20))
            wait = max(wait, ceiling * random.uniform(0.5, 1.0))  # never sooner than a plain poll
            log.warning(
                "no Alertmanager took the alerts due (%d round(s)); next try in %.1fs", self.failures, wait
            )
        self.delivery.metrics.alert_backoff.set(wait if self.failures else 0)
        self.delivery.metrics.alert_failures.set(self.failures)
        return wait

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Stop ``task`` (this pager's :meth:`run_forever`), deliver what is pending if the
        Alertmanagers answer within the alerting timeout, and close the connections."""
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.drain(), timeout=self.settings.alerting.timeout_seconds)
        await self.delivery.aclose()

    async def drain(self) -> int:
        """Deliver claimed events in order; return how many were delivered."""
        done = 0
        while batch := await asyncio.to_thread(self._claim):
            delivered, stopped = await self._deliver(batch)
            done += delivered
            if stopped:
                break
        return done

    async def resend_if_due(self) -> bool:
        """Re-send every open (and recently resolved) incident's alert once per resend interval."""
        now = self.clock()
        interval = timedelta(seconds=self.settings.alerting.resend_interval_seconds)
        if self._last_resend is not None and now - self._last_resend < interval:
            return False
        incidents = await asyncio.to_thread(self._alerting_incidents, now)
        alerts = [self.alert(i, i.severity, firing=i.state == "open", now=now) for i in incidents]
        if alerts:
            accepted, _, why = await self.delivery.post(alerts)
            if not accepted:
                log.warning("could not re-send %d alert(s): %s", len(alerts), why)
                self._round_failed = True
                return False
        self._last_resend = now
        return True

    # --- one event at a time -------------------------------------------------------------------

    async def _deliver(self, batch: list[PendingEvent]) -> tuple[int, bool]:
        claimed = time.monotonic()
        for i, event in enumerate(batch):
            if time.monotonic() - claimed > self.lease_seconds / 2:
                # Slow Alertmanagers: stop well before the claim lapses and another pager takes these
                # events while this one still sends them (twice, and out of order). Claimed again next.
                await asyncio.to_thread(self._release, [e.id for e in batch[i:]])
                return i, False
            accepted, permanent, why = await self.delivery.post(self.alerts_for(event))
            if accepted or permanent:
                if permanent:
                    log.error(
                        "alert for incident %d refused by every Alertmanager: %s", event.incident.id, why
                    )
                await asyncio.to_thread(self._mark, [event.id], None if accepted else why)
                continue
            log.warning("alert delivery failed (%s); %d event(s) wait", why, len(batch) - i)
            self._round_failed = True
            await asyncio.to_thread(self._give_back, [event.id], why)  # the one tried: an attempt
            if batch[i + 1 :]:
                await asyncio.to_thread(self._release, [e.id for e in batch[i + 1 :]])  # never tried
            return i, True
        return len(batch), False

    def alerts_for(self, event: PendingEvent) -> list[dict[str, Any]]:
        """Return the alerts one incident event sends (two for an escalation)."""
        now = self.clock()
        incident = event.incident
        if event.kind in ("resolved", "dismissed"):
            return [self.alert(incident, event.new_severity, firing=False, now=now, ended=event.created_at)]
        alerts = [self.alert(incident, event.new_severity, firing=True, now=now)]
        if event.kind == "escalated" and event.old_severity and event.old_severity != event.new_severity:
            alerts.append(
                self.alert(incident, event.old_severity, firing=False, now=now, ended=event.created_at)
            )
        if event.kind in ("proven", "confirmed"):  # the suspected alert ends: its labels differ
            was = dataclasses.replace(incident, certainty="suspected")
            alerts.append(self.alert(was, event.new_severity, firing=False, now=now, ended=event.created_at))
        return alerts

    def alert(
        self,
        incident: IncidentView,
        severity: str,
        *,
        firing: bool,
        now: datetime,
        ended: datetime | None = None,
    ) -> dict[str, Any]:
        """Return one Alertmanager alert for ``incident`` at ``severity``."""
        base = self.settings.api.base_url
        runbooks = runbook_base(self.settings)
        name = ALERTNAMES[severity]
        labels = {
            "alertname": name, "target": incident.target, "probe": incident.probe, "severity": severity,
            "certainty": incident.certainty,
        }  # fmt: skip
        if incident.node:
            labels["node"] = incident.node
        # An incident keeps only its kind: the traffic check that stores results under it, if any.
        traffic_check = TRAFFIC_CHECKS.get(incident.probe)
        if traffic_check is not None:
            labels["check"] = traffic_check.name
        link = incident_url(base, incident.id, incident.opened_at, self.link_key)
        if firing:
            ends = now + timedelta(seconds=4 * self.settings.alerting.resend_interval_seconds)
        else:
            ends = ended or incident.resolved_at or now
        return {
            "labels": labels,
            "annotations": {
                "summary": plain(incident.title, SUMMARY_CHARS),
                "description": plain(describe(incident), DESCRIPTION_CHARS),
                "runbook_url": f"{runbooks}/{name}",
                "incident_url": link,
                **(
                    {"containment": plain(incident.containment, SUMMARY_CHARS)}
                    if incident.containment
                    else {}
                ),
            },
            "startsAt": _rfc3339(incident.opened_at),
            "endsAt": _rfc3339(ends),
            "generatorURL": link,
        }

    # --- database, in threads ------------------------------------------------------------------

    def _claim(self) -> list[PendingEvent]:
        with self.session_factory() as session, session.begin():
            return outbox.claim(
                session, claimer=self.claimer, now=self.clock(), lease_seconds=self.lease_seconds
            )

    def _mark(self, ids: list[int], refused: str | None) -> None:
        error = f"refused: {refused}" if refused else None
        with self.session_factory() as session, session.begin():
            outbox.delivered(session, event_ids=ids, claimer=self.claimer, now=self.clock(), error=error)

    def _release(self, ids: list[int]) -> None:
        with self.session_factory() as session, session.begin():
            outbox.release(session, event_ids=ids, claimer=self.claimer)

    def _give_back(self, ids: list[int], why: str) -> None:
        with self.session_factory() as session, session.begin():
            outbox.failed(session, event_ids=ids, claimer=self.claimer, error=why)

    def _alerting_incidents(self, now: datetime) -> list[IncidentView]:
        with self.session_factory() as session:
            return outbox.alerting_incidents(
                session, now=now, resolved_within_seconds=RESOLVED_RESEND_SECONDS
            )


def describe(incident: IncidentView) -> str:
    """Return the alert's description: what was found, with figures, and never a target's own text."""
    result = incident.result
    where = f"{incident.target}/{incident.probe}" + (f" on node {incident.node}" if incident.node else "")
    verdict, reason = result.get("verdict", incident.severity), result.get("reason", incident.last_reason)
    lines = [f"{verdict} on {where} ({reason})."]
    if result.get("detail"):
        lines.append(str(result["detail"])[:400])
    sent, reported = result.get("prompt_tokens_sent"), result.get("prompt_tokens_reported")
    if sent is not None or reported is not None:
        lines.append(f"Prompt tokens sent {sent}, reported by the engine {reported}.")
    evidence = result.get("evidence") or {}
    capacity = evidence.get("capacity") if isinstance(evidence, dict) else None
    if isinstance(capacity, dict) and (capacity.get("context_window") or capacity.get("kv_pool_tokens")):
        window, pool = capacity.get("context_window"), capacity.get("kv_pool_tokens")
        lines.append(f"Context window {window} tokens, KV pool {pool} tokens.")
    leaks = evidence.get("leaks") if isinstance(evidence, dict) else None
    if isinstance(leaks, list) and leaks:
        ids = ", ".join(
            f"{h.get('marker_id')} (of {h.get('owner_tenant')}, read by {h.get('reader_tenant')})"
            for h in leaks[:4]
            if isinstance(h, dict)
        )
        lines.append(f"Foreign markers: {ids}.")
    lines.append(f"Failures counted: {incident.failure_count}.")
    return " ".join(lines)


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def paging_health(backlog: Callable[[], tuple[int, float]], resend_interval: float) -> dict[str, Any]:
    """Say whether paging keeps up (``/healthz``): a backlog older than three resend intervals is
    stalled; ``backlog`` returns the undelivered events and the oldest one's age in seconds."""
    try:
        events, oldest = backlog()
    except Exception:
        return {"status": "unknown"}
    status = "stalled" if oldest > 3 * resend_interval else "ok"
    return {"status": status, "outbox_events": events, "oldest_age_seconds": round(oldest, 1)}
