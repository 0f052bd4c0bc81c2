"""What an engine writes is data: a hostile server info cannot reach a title, a page, an alert, the
terminal or the metrics as markup, control characters or unbounded series.

An engine on loopback publishes pool names and a version holding markup, bidi overrides, ESC, BEL
and NUL, with a pool below its context window (so the capacity audit opens an incident), and then
thousands of fresh pool names per audit. `kvcanary check` and `kvcanary serve` (with a real
Alertmanager) read it through their real interfaces.
"""

from __future__ import annotations

import json
import random
import string
import unicodedata
from collections.abc import Callable
from typing import Any

import yaml

from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import REFERENCE_INFO, FakeEngine
from tests.support.loopback import Loopback
from tests.support.services import Alertmanager

HOSTILE = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "\u202eevil\u202c",
    "\x1b[2J\x1b[31mred",
    "bell\x07",
    "nul\x00byte",
]


def hostile_info() -> dict[str, Any]:
    pools = {name: 512 + i for i, name in enumerate(HOSTILE)}
    return {**REFERENCE_INFO, "version": "0.5.9\u202e<b>x</b>\x1b[0m", "kv_pools": pools}


def assert_inert(text: str, where: str) -> None:
    """No markup the engine wrote, and no control or format character, survives in ``text``."""
    for markup in ("<script", "<img", "<b>x"):
        at = text.find(markup)
        assert at < 0, (where, text[max(0, at - 200) : at + 100])
    bad = {c for c in text if unicodedata.category(c) in ("Cc", "Cf") and c not in "\n\t"}
    assert not bad, (where, sorted(map(hex, map(ord, bad))))


def test_kvcanary_check_prints_what_a_hostile_engine_wrote_as_plain_text(
    served: Callable[[dict[str, Any]], Served],
) -> None:
    engine = FakeEngine(info=hostile_info())
    server = Loopback(engine)
    try:
        target = reference_target("hostile", server.url, probes=["capacity", "version"])
        monitor = served({"targets": [target]})
        monitor.write_config()
        for args in ([], ["--json"]):
            done = monitor.kvcanary("check", "--config", str(monitor.config_path), *args)
            assert done.returncode in (1, 3), done.stderr
            assert_inert(done.stdout + done.stderr, f"check {args}")
        assert "pool_below_context_window" in done.stdout
    finally:
        server.close()


def test_serve_keeps_hostile_engine_text_out_of_titles_pages_alerts_and_series(
    served: Callable[[dict[str, Any]], Served], alertmanager: Alertmanager
) -> None:
    engine = FakeEngine(info=hostile_info())
    server = Loopback(engine)
    target = reference_target("hostile", server.url, probes=["capacity"], probe_intervals={"capacity": 0.5})
    monitor = served(
        {
            "targets": [target],
            "alertmanagers": [alertmanager.url],
            "alerting": {"resend_interval_seconds": 1, "poll_interval_seconds": 0.2},
        }
    )
    try:
        monitor.start()
        incidents = monitor.wait_for(
            "the capacity incident", lambda: monitor.get("/api/v1/incidents").json()["items"]
        )
        title = incidents[0]["title"]
        assert "pool" in title
        assert_inert(json.dumps(incidents, ensure_ascii=False), "REST incidents")
        detail = monitor.get(f"/api/v1/incidents/{incidents[0]['id']}").json()
        assert_inert(json.dumps(detail, ensure_ascii=False), "REST incident detail")
        page = monitor.get(f"/incidents/{incidents[0]['id']}").text
        assert_inert(page, "incident page")
        alerts = monitor.wait_for("the alert in Alertmanager", lambda: alertmanager.alerts(target="hostile"))
        assert_inert(json.dumps(alerts[0]["annotations"], ensure_ascii=False), "Alertmanager annotations")

        # Then thousands of fresh pool names at every audit: the series stay bounded per node.
        def churn(_: Any) -> dict[str, Any]:
            names = ("".join(random.choices(string.ascii_lowercase, k=12)) for _ in range(2000))
            return {**REFERENCE_INFO, "kv_pools": {n: 4096 + i for i, n in enumerate(names)}}

        engine.info = None
        server.handler = ChurningInfo(engine, churn)
        monitor.wait_for("a few audits of churning pools", lambda: server.handler.reads >= 6, timeout=30)
        series = monitor.samples("kvcanary_node_kv_pool_tokens")
        assert 0 < len(series) <= 16, len(series)
        assert not any(labels["pool"] in HOSTILE for labels, _ in series)  # the first audit's are gone
        assert_inert(monitor.log(), "the monitor's log")
        assert_inert(yaml.safe_dump(series), "metric labels")
    finally:
        server.close()


class ChurningInfo:
    """Serve ``info(request)`` at the server-info paths, and everything else from ``engine``."""

    def __init__(self, engine: FakeEngine, info: Callable[[Any], dict[str, Any]]):
        self.engine, self.info, self.reads = engine, info, 0

    async def __call__(self, request: Any) -> Any:
        import httpx

        if request.url.path in ("/get_server_info", "/server_info"):
            self.reads += 1
            return httpx.Response(200, json=self.info(request))
        return await self.engine(request)
