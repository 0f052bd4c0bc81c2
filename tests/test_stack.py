"""The whole observability path with real parts: workers, two monitors, Prometheus, Alertmanager.

A healthy and a defective reference worker (the incident's configuration at toy scale) are probed
by two ``kvcanary serve`` processes sharing one PostgreSQL database; Prometheus scrapes both
monitors and both workers and evaluates ``alerts/kvcanary.rules.yml``; everything alerts into one
real Alertmanager. The test checks, through each server's own API:

- the leak reaches Alertmanager from the monitors' push (``KVCanaryLeak``) and from Prometheus's
  rules on the monitor's and the worker's metrics, and the time from the first leaking response to
  the alert in Alertmanager is measured;
- the two monitors drained one outbox: every incident event was delivered exactly once;
- every rule expression and every dashboard panel query returns data, except those listed below
  with the reason they are quiet in this deployment;
- the defective worker restarted with the fix: the incidents resolve and the pushed alert ends.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import create_engine, text

from kvcanary.monitor.commands.dashboards import panel_queries
from tests.support import (
    REPO,
    WorkerProcess,
    free_port,
    own_database,
    stop_process,
    wait_http,
)
from tests.support.services import Alertmanager, Prometheus, start_alertmanager, start_prometheus, wait_for

pytestmark = [pytest.mark.external_service, pytest.mark.slow]

RULES = REPO / "alerts" / "kvcanary.rules.yml"
#: What Prometheus loads: the rules above and the SLOs' (whose budgets a panel reads).
RULE_FILES = sorted((REPO / "alerts").glob("*.rules.yml"))
HEALTHY = ["--mode", "aggregated", "--kv-pool-tokens", "16384", "--context-window", "8192"]
POOL = ["--prefill-pool-tokens", "1024", "--decode-pool-tokens", "16384", "--context-window", "8192"]
DEFECTIVE = ["--mode", "disaggregated", "--admission", "placeholder", *POOL]
FIXED = ["--mode", "disaggregated", "--admission", "reject", *POOL]
PROBES = {"canary": 2.0, "cross_tenant": 2.0, "boundary": 3.0, "counters": 2.0, "capacity": 4.0}

#: Rules that stay quiet here, and why: nothing in this deployment is in that failure.
QUIET_RULES = {
    "KVCanaryProbeErrors": "every probe judges (no target is unreachable)",
    "KVCanaryLeakSuspected": "no gateway sends traffic here, so no fingerprint check suspects anything "
    "(alerts/tests/monitor.test.yml runs its series; tests/litellm/test_suspected_litellm.py raises one "
    "through a real LiteLLM proxy)",
    "KVCanaryNotProbing": "both monitors probe every pair on time",
    "KVCanaryAlertDeliveryFailing": "Alertmanager accepts every post",
    "KVCanaryResultsDropped": "the database is up: nothing is spooled, nothing dropped",
    "KVCanarySpoolNotDraining": "every result is written: the spool stays empty",
    "KVCanaryDatabaseDown": "the database is up",
    "KVCanaryOwnershipViolation": "no worker verifies ownership here (tests/probes/test_counters.py does)",
    "KVCanaryDirtyPageReuse": "no worker here is configured to zero freed pages",
    "KVCanaryPathNotJudged": "no prefill x decode paths here (tests/monitor/runs/test_gateway_paths.py "
    "fires the rule in a real Prometheus over a real gateway's paths)",
    "KVCanaryPathsUnprobed": "no prefill x decode paths here (alerts/tests/paths.test.yml runs its series)",
    "KVCanaryTrafficStreamBehind": "no traffic stream here (alerts/tests/pipeline.test.yml runs its series)",
    "KVCanaryTrafficPartitionsUnconsumed": "no traffic stream here (alerts/tests/traffic_stream.test.yml "
    "and tests/monitor/traffic/test_traffic_jetstream_faults.py run its series)",
    "KVCanaryTrafficBucketForged": "no traffic stream here (alerts/tests/traffic_bucket.test.yml and "
    "tests/monitor/traffic/test_traffic_bucket_rogue.py run its series)",
    "KVCanaryNodePoolUntrusted": "no gateway sends traffic here, so no node's pool is read to guard or judge "
    "it (alerts/tests/pool_trust.test.yml runs its series)",
    "KVCanaryPDTransferUnverified": "no prefill or decode node here (alerts/tests/pd_checksum.test.yml runs "
    "its series)",
    "KVCanaryQuarantineForged": "no quarantine bucket here (alerts/tests/containment.test.yml and "
    "tests/litellm/test_containment_litellm.py run its series)",
    "KVCanaryContainmentUnapplied": "no target's policy quarantines here (alerts/tests/containment.test.yml "
    "and tests/monitor/containment/test_signing_served.py run its series)",
}
#: Prometheus's rules that must fire on the defective worker, from the monitor's and the worker's metrics.
RULES_FIRING = (
    "KVCanaryLeakDetected",
    "KVCanaryPlaceholderSubstitution",
    "KVCanaryNodeCapacityBelowContextWindow",
)
#: Panel queries that stay empty here, and why.
QUIET_PANELS = {
    "Last pass": "filters on a pass older than the run (> 0) — present once any pair has passed",
    # No gateway sends traffic in this stack: tests/litellm runs the tap through a real proxy, and
    # tests/dashboards/test_promql.py runs these queries on a real Prometheus over contract data.
    **dict.fromkeys(
        (
            "Customer records flagged",
            "Flagged records by check",
            "Records judged, unmatched and dropped",
            "Traffic stream replicas",
            "Traffic stream lag",
            "Traffic stream: records taken",
            "Traffic stream partitions unconsumed",
            "Traffic stream bucket anomalies",
            "Refused by the gateways",
        ),
        "no gateway tap posts traffic in this stack",
    ),
    "Path age, in intervals": "no prefill x decode paths here (tests/monitor/runs/test_gateway_paths.py)",
    "Pairs not probed": "no prefill x decode nodes here (tests/dashboards/test_promql.py runs it)",
    "Gateway nodes joining and leaving": "no SGLang gateway here (tests/dashboards/test_promql.py runs it)",
}


class Stack:
    """The servers of one run, their addresses and their secrets."""

    def __init__(self, tmp: Path, database_url: str, start_worker: Callable[..., WorkerProcess]):
        self.tmp = tmp
        self.keys = {"tenant-a": "sk-a-" + secrets.token_hex(12), "tenant-b": "sk-b-" + secrets.token_hex(12)}
        self.token = secrets.token_urlsafe(24)
        self.keys_file = tmp / "worker-keys"
        self.keys_file.write_text("".join(f"{k}={t}\n" for t, k in self.keys.items()))
        self.start_worker = start_worker
        self.healthy = start_worker(*HEALTHY, "--api-keys-file", str(self.keys_file))
        self.defective = start_worker(*DEFECTIVE, "--api-keys-file", str(self.keys_file))
        self.alertmanager: Alertmanager = start_alertmanager(tmp / "am")
        self.database_url = database_url
        self.monitors: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def serve(self, index: int) -> str:
        port = free_port()
        config = tmp_config(self, port)
        path = self.tmp / f"kvcanary-{index}.yml"
        path.write_text(yaml.safe_dump(config))
        env = {
            **os.environ,
            "KVCANARY_API_TOKEN": self.token,
            "KVC_A": self.keys["tenant-a"],
            "KVC_B": self.keys["tenant-b"],
            "KVCANARY_STATE_DIR": str(self.tmp / f"state-{index}"),
        }
        if index == 0:
            subprocess.run([sys.executable, "-m", "monitor", "db", "upgrade", "--config", str(path)],
                           check=True, cwd=REPO, env=env, capture_output=True, timeout=120)  # fmt: skip
        log = self.tmp / f"monitor-{index}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "monitor", "serve", "--config", str(path)],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", timeout=60, proc=proc)
        self.monitors.append((url, proc, log))
        return url

    def api(self, path: str, **params: Any) -> Any:
        url = self.monitors[0][0]
        headers = {"Authorization": f"Bearer {self.token}"}
        response = httpx.get(url + path, params=params, headers=headers, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self) -> None:
        for _, proc, _ in self.monitors:
            stop_process(proc, timeout=30)
        self.alertmanager.stop()


def tmp_config(stack: Stack, port: int) -> dict[str, Any]:
    tenants = [{"name": "tenant-a", "api_key_env": "KVC_A"}, {"name": "tenant-b", "api_key_env": "KVC_B"}]
    return {
        "database_url": stack.database_url,
        "api": {"listen": f"127.0.0.1:{port}", "public_url": f"http://127.0.0.1:{port}"},
        "incidents": {"resolve_after_passes": 2},
        "scheduler": {"jitter_seconds": 0.2, "max_concurrency": 8},
        "alertmanagers": [stack.alertmanager.url],
        "alerting": {"resend_interval_seconds": 5, "poll_interval_seconds": 0.5},
        "targets": [
            {
                "name": name,
                "base_url": worker.url,
                "engine": "reference",
                "model": "kvcanary-reference",
                "tenants": tenants,
                "interval_seconds": 1,
                "timeout_seconds": 15,
                "probes": list(PROBES),
                "probe_intervals": PROBES,
            }
            for name, worker in (("healthy", stack.healthy), ("defective", stack.defective))
        ],
    }


@pytest.fixture
def database_url() -> Iterator[str]:
    yield from own_database("kvcanary_stack")


@pytest.fixture
def stack(tmp_path: Path, database_url: str, start_worker: Callable[..., WorkerProcess]) -> Iterator[Stack]:
    running = Stack(tmp_path, database_url, start_worker)
    yield running
    running.stop()


def hostport(url: str) -> str:
    return url.removeprefix("http://")


def test_a_leak_pages_through_both_doors_once_and_every_query_has_data(stack: Stack) -> None:
    stack.serve(0)
    stack.serve(1)
    prometheus = start_prometheus(
        stack.tmp / "prom",
        {
            "kvcanary": [hostport(url) for url, _, _ in stack.monitors],
            "kvcanary-workers": [hostport(stack.healthy.url), hostport(stack.defective.url)],
        },
        rule_files=RULE_FILES,
        alertmanager=stack.alertmanager.url,
    )
    try:
        pushed = wait_for(
            lambda: stack.alertmanager.alerts(alertname="KVCanaryLeak"), 90, "the pushed leak alert"
        )
        leaks = stack.api("/api/v1/probe-results", verdict="leak", target="defective", limit=500)["items"]
        first_leak = min(datetime.fromisoformat(r["started_at"]).timestamp() for r in leaks)
        # When Alertmanager took the first leak alert, as the pager recorded it (polling here would
        # add the second monitor's and Prometheus's start-up to the figure).
        latency = first_delivery(stack, pushed) - first_leak
        print(f"\nfirst leaking response -> alert in Alertmanager: {latency:.1f} s")
        assert latency < max(PROBES.values()) + 10  # one probe interval plus 10 seconds
        assert pushed[0]["labels"]["target"] == "defective"
        link = pushed[0]["annotations"]["incident_url"]
        assert any(link.startswith(f"{url}/incidents/") for url, _, _ in stack.monitors), link
        page = httpx.get(link, timeout=10)  # as the person paged opens it: no bearer token
        assert page.status_code == 200 and "KVCanaryLeak" in page.text, page.text[:300]
        assert "Foreign markers" in pushed[0]["annotations"]["description"]
        for name, hold in rules_expected_to_fire().items():
            # Rules held by `for:` are pending here (minutes); the others reach Alertmanager at once.
            if hold:
                found = lambda n=name: [a for a in prometheus.alerts() if a["labels"]["alertname"] == n]  # noqa: E731
            else:
                found = lambda n=name: stack.alertmanager.alerts(alertname=n)  # noqa: E731
            wait_for(found, 60, f"Prometheus's {name} ({'pending' if hold else 'in Alertmanager'})")
        check_rules_and_panels(prometheus)
        assert_each_event_delivered_once(stack)
        fix_and_resolve(stack)
    finally:
        prometheus.stop()


def rules_expected_to_fire() -> dict[str, bool]:
    """Return each rule of RULES_FIRING with whether a ``for:`` holds it pending first."""
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return {r["alert"]: bool(r.get("for")) for r in rules if r["alert"] in RULES_FIRING}


def check_rules_and_panels(prometheus: Prometheus) -> None:
    """Every rule and panel query returns data, unless listed as quiet here with its reason."""
    rules = yaml.safe_load(RULES.read_text())["groups"]
    for group in rules:
        for rule in group["rules"]:
            if rule["alert"] in QUIET_RULES:
                # Read until quiet (at most 20 s), as the rule's `for:` would: one late run on a
                # loaded machine makes a staleness expression true for a moment.
                wait_for(
                    lambda e=rule["expr"]: prometheus.query(e) == [],
                    20,
                    f"{rule['alert']} to be quiet: {QUIET_RULES[rule['alert']]}",
                )
            else:
                assert prometheus.query(rule["expr"]), f"{rule['alert']} returns no data: {rule['expr']}"
    empty = []
    for uid, title, expr in panel_queries():
        if not prometheus.query(expr) and title not in QUIET_PANELS:
            empty.append(f"{uid} / {title}: {expr}")
    assert empty == []


def first_delivery(stack: Stack, alerts: list[dict[str, Any]]) -> float:
    """Unix time Alertmanager first accepted an event of the incidents these alerts link to."""
    ids = [int(a["annotations"]["incident_url"].split("?")[0].rsplit("/", 1)[1]) for a in alerts]
    engine = create_engine(stack.database_url)
    with engine.connect() as conn:
        query = text("SELECT min(processed_at) FROM incident_event WHERE incident_id = ANY(:ids)")
        delivered = conn.execute(query, {"ids": ids}).scalar_one()
    engine.dispose()
    assert delivered is not None, f"no delivered event for incidents {ids}"
    return float(delivered.timestamp())


def assert_each_event_delivered_once(stack: Stack) -> None:
    engine = create_engine(stack.database_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT attempts, processed_at, claimed_by FROM incident_event")).all()
    engine.dispose()
    assert rows, "no incident event at all"
    delivered = [r for r in rows if r.processed_at is not None]
    assert all(r.attempts == 1 for r in delivered), rows
    assert len({r.claimed_by for r in delivered}) >= 1


def fix_and_resolve(stack: Stack) -> None:
    port = stack.defective.port
    stack.defective.stop()
    stack.start_worker(*FIXED, "--api-keys-file", str(stack.keys_file), port=port)

    def resolved() -> bool:
        open_ = stack.api("/api/v1/incidents", target="defective", state="open")["items"]
        return not [i for i in open_ if i["probe"] != "capacity"]  # the pool stays below the window

    wait_for(resolved, 90, "the defective target's leak incidents to resolve")
    wait_for(lambda: stack.alertmanager.alerts(alertname="KVCanaryLeak") == [], 30, "the pushed alert to end")
