"""SIGHUP and `POST /-/reload` take up a changed config file without a restart; a bad file is
refused naming the key, and the configuration in force stays. On main SIGHUP ended `serve`
within 3 s, with no log line and no drain."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import httpx

from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import FakeEngine
from tests.support.loopback import Loopback

FAST = {"interval_seconds": 0.5, "probes": ["canary"]}


class Slow(FakeEngine):
    """Answers like the reference worker, three seconds late; counts requests that arrived."""

    arrived: int = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("completions"):
            self.arrived += 1
            await asyncio.sleep(3)
        return await super().__call__(request)


def runs(monitor: Served, target: str) -> float:
    return monitor.value("kvcanary_probe_runs_total", target=target) or 0.0


def test_sighup_and_post_reload_take_up_the_file_and_refuse_a_bad_one(
    served: Callable[[dict[str, Any]], Served],
) -> None:
    fast, slow = Loopback(FakeEngine()), Slow()
    slow_server = Loopback(slow)
    a = reference_target("a", fast.url, **FAST)
    gone = reference_target("gone", slow_server.url, **FAST)
    monitor = served({"targets": [a, gone]})
    try:
        monitor.start()
        monitor.wait_for("runs on a", lambda: runs(monitor, "a") >= 2)
        monitor.wait_for("a run in flight on gone", lambda: slow.arrived >= 1)
        loaded_at = monitor.value("kvcanary_config_last_reload_success_timestamp_seconds")

        # Add b, change a (a second kind), remove gone while its run is in flight.
        b = reference_target("b", fast.url, **FAST)
        changed = {**monitor.config, "targets": [{**a, "probes": ["canary", "capacity"]}, b]}
        monitor.write_config(changed)
        monitor.signal(signal.SIGHUP)
        monitor.wait_for("b to run", lambda: runs(monitor, "b") >= 2)
        assert monitor.proc is not None and monitor.proc.poll() is None
        assert "reloaded" in monitor.log() and "1 added, 1 removed, 1 changed target(s)" in monitor.log()
        names = [t["name"] for t in monitor.get("/api/v1/targets").json()["items"]]
        assert sorted(names) == ["a", "b"]
        monitor.wait_for(
            "gone's run in flight to end and be recorded", lambda: "gone/canary: pass" in monitor.log()
        )
        monitor.wait_for(
            "gone's series to go", lambda: monitor.value("kvcanary_probe_runs_total", target="gone") is None
        )
        monitor.wait_for(
            "a's new kind", lambda: monitor.value("kvcanary_probe_runs_total", target="a", probe="capacity")
        )
        assert monitor.value("kvcanary_config_last_reload_successful") == 1
        assert monitor.value("kvcanary_config_last_reload_success_timestamp_seconds") > loaded_at

        # A bad file: refused with a log line naming the key; what is in force stays.
        bad = {**changed, "targets": [{**b, "interval_seconds": -1}]}
        monitor.write_config(bad)
        monitor.signal(signal.SIGHUP)
        monitor.wait_for("the refusal", lambda: "reload (SIGHUP) refused" in monitor.log())
        assert "targets[0].interval_seconds" in monitor.log()
        assert monitor.value("kvcanary_config_last_reload_successful") == 0
        before = runs(monitor, "a")
        monitor.wait_for("a to keep running", lambda: runs(monitor, "a") > before)
        refused = monitor.post("/-/reload")
        assert refused.status_code == 400 and "interval_seconds" in refused.json()["detail"]
        assert monitor.post("/-/reload", token="wrong-token-0123456789").status_code == 401

        # A key that needs a restart is refused as a whole.
        monitor.write_config({**changed, "database_url": "sqlite:////tmp/elsewhere.db"})
        refused = monitor.post("/-/reload")
        assert refused.status_code == 400 and "database_url" in refused.json()["detail"]

        monitor.write_config({**changed, "targets": [a]})
        assert monitor.post("/-/reload").json() == {"status": "reloaded"}
        assert monitor.value("kvcanary_config_last_reload_successful") == 1
        monitor.wait_for(
            "b's series to go", lambda: monitor.value("kvcanary_probe_runs_total", target="b") is None
        )
        assert "Traceback" not in monitor.log()
        # The clock ran every job many times over: none of it in the log at INFO (it buried the lines
        # a reader needs, and a test's log tail).
        assert "Running job" not in monitor.log() and "executed successfully" not in monitor.log()
    finally:
        monitor.stop()
        fast.close()
        slow_server.close()
