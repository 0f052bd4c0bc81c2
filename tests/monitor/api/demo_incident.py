"""The demo's incident, made by the monitor's own parts and served as the service serves it.

:func:`demo_incident` starts a reference worker with the demo's defect (``WORKERS["defective"]`` of
``demo/run.py``: a 2,048-token prefill pool behind an 8,192-token window, placeholder
admission), runs the real ``capacity`` and ``boundary`` probes against it through the runner and its
batch writer, serves the service's app (``build_http_app``) under uvicorn on loopback, and posts two
hours of a gateway's traffic to ``POST /api/v1/traffic`` as a tap does. Then it goes through the
incident's life: the pages Alertmanager takes, the quarantine the rules put on (observed, then
enforced once the policy says so), the node fixed (its pool as large as its window: the capacity
audit sees the change), the passes that resolve it, the quarantine lifted.

Everything runs in the server's one event loop, as in ``kvcanary serve``: the runner, the traffic
judge and the pager share the target's client, whose tokenizer calibration sizes the gateway's
over-pool prompts (they report 1 token: the defect's signature).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.demo.run import WORKERS
from kvcanary.monitor.api.main import build_http_app
from kvcanary.monitor.api.state import ApiState
from kvcanary.monitor.config.settings import Settings, parse_settings
from kvcanary.monitor.containment.rules import QuarantineRules
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.paging.pager import Delivery, Pager
from kvcanary.monitor.recording.recorder import Recorder
from kvcanary.monitor.recording.spool import Spool
from kvcanary.monitor.recording.writer import BatchWriter
from kvcanary.monitor.runs.run_now import RunNow
from kvcanary.monitor.runs.runner import ProbeRunner, RunSummary
from kvcanary.monitor.storage.target_rows import upsert_targets
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.monitor.traffic.ingest import HttpIngest
from kvcanary.monitor.traffic.judge import TrafficJudge, own_key_digests
from kvcanary.monitor.traffic.pipeline import TrafficPipeline
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from kvcanary.processes import free_port
from kvcanary.wire import VERSION
from tests.support import WorkerProcess, launch_worker, wait_worker

T = TypeVar("T")
Factory = sessionmaker[Session]

TOKEN = "kvc-test-token-0123456789abcdef"  # the API's bearer token, which signs the pages' links
#: A production-like deployment name: long, as the page must show one on a phone.
TARGET = "glm-5.3-prod-eu-west-1-disaggregated-prefill-07"
KEYS = {"tenant-a": "kvc-demo-key-tenant-a-0001", "tenant-b": "kvc-demo-key-tenant-b-0002"}
#: The gateway's callers: names as teams and service accounts have them, two of them long and one
#: with nowhere to break (a phone's line is 45 characters of it).
CALLERS = (
    "acme-payments-eu-west-1-production-batch-inference",
    "globex",
    "initech-customer-support-assistant",
    "svc-inference@umbrella-research-prod-4412.iam.gserviceaccount.com",
    "hooli_search_ranking_offline_eval_pipeline_eu_west_1",
    "security-reporter",
)
#: The caller the operator leaves out (the one who reported the leak).
REPORTER = "security-reporter"
#: How long the monitor has watched the target when the leak is found, and the traffic spans.
WATCHED = timedelta(hours=2)
#: The gateway's prompt sizes in characters: short ones, and long ones over the pool.
SHORT, LONG = (300, 900, 1500), (40_000, 60_000)
#: The node after the fix: a pool as large as its context window.
FIXED = ["--mode", "disaggregated", "--admission", "placeholder", "--prefill-pool-tokens", "8192",
         "--decode-pool-tokens", "16384", "--context-window", "8192"]  # fmt: skip


@dataclass
class Sent:
    """One request the gateway relayed, as the test sent it (the ground truth)."""

    id: str
    caller: str
    own: bool
    time: float
    chars: int
    status: int

    @property
    def over_pool(self) -> bool:
        """Over the node's 2,048-token pool and answered 2xx. The prompts are short (at most
        ``SHORT`` characters: under the pool at any tokenizer's ratio of ASCII text) or long (at
        least 20 characters a token over it): the truth needs no tokenizer of its own."""
        return self.chars >= min(LONG) and 200 <= self.status < 300


@dataclass
class DemoIncident:
    """The incident as served: where its page is, and what the test knows to be true of it."""

    base_url: str
    incident_id: int
    link: str  # the incident_url of the alert Alertmanager holds
    sent: list[Sent]

    def radius(self) -> dict[str, Any]:
        """The blast radius as the API answers it (what the page shows)."""
        return self._get("/blast-radius")

    def incident(self) -> dict[str, Any]:
        return self._get("")

    def _get(self, tail: str) -> dict[str, Any]:
        url = f"{self.base_url}/api/v1/incidents/{self.incident_id}{tail}"
        answer = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        answer.raise_for_status()
        body: dict[str, Any] = answer.json()
        return body

    def affected_by_caller(self, start: float, end: float) -> dict[str, int]:
        """The over-pool 2xx responses each customer got between ``start`` and ``end`` (epoch)."""
        inside = [s for s in self.sent if start <= s.time <= end and s.over_pool and not s.own]
        return dict(Counter(s.caller for s in inside if s.caller != REPORTER))


class LoopServer:
    """The app under uvicorn on a loopback port, in a thread of its own with its own event loop."""

    def __init__(self, app: Any, port: int):
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.url = f"http://127.0.0.1:{port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.05)

    def run(self, work: Coroutine[Any, Any, T], timeout: float = 180) -> T:
        """Run ``work`` on the server's loop (where the shared clients live); return its result."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.loop.close()


def demo_settings(url: str, base: str, alertmanager: str, *, enforce: bool) -> Settings:
    """The monitor's settings: the demo's target (its tenants, capacity and boundary) behind a
    gateway; containment observes until ``enforce``, and lifts at once after recovery."""
    containment = {"mode": "quarantine" if enforce else "observe", "lift_after_seconds": 0}
    return parse_settings(
        {
            "api": {"public_url": base},
            "alertmanagers": [alertmanager],
            "incidents": {"resolve_after_passes": 3},
            "containment": containment,
            "blast_radius": {"exclude_callers": [REPORTER]},
            "targets": [
                {
                    "name": TARGET,
                    "base_url": url,
                    "engine": "reference",
                    "model": "kvcanary-reference",
                    "tenants": [{"name": t} for t in KEYS],
                    "timeout_seconds": 30,
                    "probes": ["capacity", "boundary"],
                }
            ],
        }
    )


def gateway_traffic(url: str, now: datetime, seed: int = 7) -> list[Sent]:
    """Two hours of the gateway's requests to the node, one every 15 s: the callers' short and long
    prompts (the long ones over the pool), a few 5xx, and the monitor's own tenants' canaries."""
    rng = random.Random(seed)
    start = (now - WATCHED).timestamp()
    sent = []
    for i in range(int(WATCHED.total_seconds() // 15)):
        own = i % 12 == 0
        caller = "kvcanary" if own else rng.choice(CALLERS)
        chars = rng.choice([*SHORT, *LONG])
        status = 200 if rng.random() < 0.93 else 503
        sent.append(Sent(f"chatcmpl-{i:05d}-{rng.getrandbits(64):016x}", caller, own,
                         start + i * 15 + rng.random() * 10, chars, status))  # fmt: skip
    return sent


def tap_record(s: Sent, url: str) -> dict[str, Any]:
    """The record a gateway's tap writes of ``s`` (``docs/tap-protocol.md``): sizes, not text; the
    defective node reports 1 prompt token for a prompt over its pool."""
    own_hash = next(iter(own_key_digests({"a": KEYS["tenant-a"]})))
    return {
        "id": s.id, "time": s.time, "caller": s.caller, "caller_kind": "team",
        "key_hash": own_hash if s.own else "", "api_base": url, "status": s.status,
        "prompt": {"chars": s.chars, "bytes": s.chars, "messages": 2},
        "usage": {"prompt_tokens": 1 if s.over_pool else s.chars // 4, "completion_tokens": 180},
    }  # fmt: skip


@contextmanager
def demo_incident(factory: Factory, alertmanager: Any, log_dir: Path) -> Iterator[DemoIncident]:
    """Yield the demo's incident, resolved, served on loopback; stop everything afterwards."""
    workers = [wait_worker(launch_worker([*WORKERS["defective"], *_key_flags()], log_dir))]
    try:
        port = free_port()
        scene = _Scene(factory, alertmanager, workers, log_dir, f"http://127.0.0.1:{port}")
        scene.server = LoopServer(build_http_app(scene.state), port)
        scene.server.start()
        try:
            yield scene.live_through()
        finally:
            scene.close()
    finally:
        for worker in workers:
            worker.stop()


class _Scene:
    """The monitor's parts around one target, wired as ``monitor/app.py`` wires them."""

    server: LoopServer

    def __init__(
        self, factory: Factory, alertmanager: Any, workers: list[WorkerProcess], log_dir: Path, base: str
    ):
        self.factory, self.alertmanager, self.workers, self.log_dir = factory, alertmanager, workers, log_dir
        self.node = workers[0]
        self.settings = demo_settings(self.node.url, base, alertmanager.url, enforce=False)
        with factory.begin() as s:  # the monitor has watched the target for two hours
            watched_since = datetime.now(UTC) - WATCHED
            upsert_targets(s, [(TARGET, "reference", self.node.url, "kvcanary-reference")], watched_since)
        self.client = OpenAIHttpTarget(self.settings.targets[0], dict(KEYS))
        clients = {TARGET: self.client}
        markers, metrics = MarkerBook(), MonitorMetrics(CollectorRegistry())
        self.writer = BatchWriter(Recorder(self.settings, factory, Spool(None)))
        self.runner = ProbeRunner(self.settings, clients, markers, metrics, self.writer)
        judge = TrafficJudge(self.settings, clients, markers, metrics, own_key_digests(KEYS))
        self.state = ApiState(
            session_factory=factory, api_token=TOKEN, settings=self.settings,
            run_now=RunNow(_no_run, min_interval=0), health=lambda: {}, metrics_page=metrics.exposition,
            traffic=HttpIngest(TrafficPipeline(judge, None, factory)), judge=judge,
        )  # fmt: skip
        delivery = Delivery({alertmanager.url: {}}, metrics, timeout=5)
        self.pager = Pager(self.settings, factory, delivery, link_key=TOKEN)

    def run(self, kind: str) -> list[RunSummary]:
        return self.server.run(self.runner.run(TARGET, kind))

    def live_through(self) -> DemoIncident:
        """Take the incident from its discovery to its resolution; return it as served."""
        self.run("capacity")
        found = self.run("boundary") + self.run("boundary")
        incident_id = found[0].outcome.incident_id if found[0].outcome else None
        leaked = any(s.result.verdict is Verdict.LEAK for s in found)
        assert incident_id is not None and leaked, [s.as_dict() for s in found]
        self.server.run(self.pager.drain())
        link = self._link_alertmanager_holds()
        rules = QuarantineRules(self.factory, lambda: self.settings)
        assert rules.sync(), "the leak quarantined nothing"  # observed: the policy is observe
        enforcing = demo_settings(self.node.url, self.server.url, self.alertmanager.url, enforce=True)
        rules.settings = lambda: enforcing
        assert rules.sync(), "the policy's change reached no gateway"
        sent = gateway_traffic(self.node.url, datetime.now(UTC))
        self.server.run(_post(self.server.url, [tap_record(s, self.node.url) for s in sent]))
        # The fix: the node restarted on its port with a pool as large as its window.
        self.node.stop()
        self.workers.append(launch_worker([*FIXED, *_key_flags()], self.log_dir, port=self.node.port))
        wait_worker(self.workers[-1])
        self.run("capacity")
        fixed = [s for _ in range(3) for s in self.run("boundary")]
        assert {s.result.verdict for s in fixed} == {Verdict.PASS}, [s.as_dict() for s in fixed]
        self.server.run(self.pager.drain())
        assert rules.sync(), "the quarantine was not lifted after recovery"
        return DemoIncident(self.server.url, incident_id, link, sent)

    def _link_alertmanager_holds(self) -> str:
        """The incident link of the page Alertmanager holds (it takes a moment to list it)."""
        deadline = time.monotonic() + 15
        while not (alerts := self.alertmanager.alerts(alertname="KVCanaryLeak")):
            assert time.monotonic() < deadline, "Alertmanager holds no KVCanaryLeak"
            time.sleep(0.2)
        return str(alerts[0]["annotations"]["incident_url"])

    def close(self) -> None:
        self.server.run(self.client.aclose())
        self.server.run(self.pager.delivery.aclose())
        self.server.stop()
        self.writer.close()


async def _post(base: str, records: list[dict[str, Any]]) -> None:
    """Post ``records`` as the gateway's tap does: batches of 100 under the API's token."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        for i in range(0, len(records), 100):
            body = {"version": VERSION, "gateway": "litellm-eu-west-1", "records": records[i : i + 100]}
            answer = await http.post(
                "/api/v1/traffic", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert answer.status_code == 200, answer.text


def _key_flags() -> list[str]:
    return [arg for tenant, key in KEYS.items() for arg in ("--api-key", f"{key}={tenant}")]


async def _no_run(name: str) -> list[dict[str, Any]]:
    raise KeyError(name)
