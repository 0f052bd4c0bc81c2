"""Every prefill x decode path behind SGLang's model gateway, probed by kvcanary itself.

The incident's topology at toy scale behind the real gateway (sglang-router 0.3.2, PD mode): prefill
``small`` has the incident's pool (1,024 tokens under an 8,192-token window) and the placeholder
defect; prefill ``roomy`` holds twice the window and refuses what it cannot hold; two plain decode
servers. ``kvcanary serve`` is given only the gateway's URL: it finds the four nodes, and sends its
path kinds (``canary`` and ``boundary``) down each of the four pairs itself, with the bootstrap
fields the gateway would add. The two paths through ``small`` leak, and the incident names the
pair; the two through ``roomy`` pass; every path is judged within one interval of the nodes being
found, whatever the gateway's policy (``cache_aware`` keeps a probe's prompt on one pair, so probes
sent through it alone may never reach ``small``). A decode node stopped leaves its two paths
unjudged: a real Prometheus scraping the monitor with ``alerts/kvcanary.rules.yml`` loaded names
exactly those in ``KVCanaryPathNotJudged``'s expression, and the alert fires for both once its
``for`` has passed.

Needs the gateway's venv (``scripts/setup-sglang-router.sh``): skipped without it, failed under
``KVCANARY_REQUIRE_SGLANG_ROUTER=1``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvcanary.monitor.config.targets import path_name
from kvcanary.monitor.targets.scrape import parse_samples
from kvcanary.processes import stop_processes
from tests.monitor.served import Served, reference_target
from tests.probes.probe_harness import KEYS
from tests.support import REPO, WorkerProcess, stop_process
from tests.support.services import start_prometheus
from tests.workers.pd_support import PrefillServer, start_servers, stop_servers

#: The probes' tenants' keys, known to every server (besides pd_support's own).
TENANT_KEYS = tuple(arg for tenant in ("alice", "bob") for arg in ("--api-key", f"{KEYS[tenant]}={tenant}"))
#: Seconds between the path kinds' runs: the bound within which every path is judged. No shorter
#: than a run's timeout (as by default): one run of a kind covers the target and its paths together,
#: and through a gateway retrying a dead decode node the target's own run lasts a timeout, which the
#: next run waits for; 8 s was too short for the boundary probe's requests on a loaded 2-core host.
INTERVAL = 15.0
RULES = REPO / "alerts" / "kvcanary.rules.yml"


@dataclass
class Fleet:
    prefills: dict[str, PrefillServer]
    decodes: dict[str, WorkerProcess]
    logs: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from tests.workers.test_pd_gateway import need_router

    need_router()
    logs = tmp_path_factory.mktemp("gateway-paths")
    roomy = ("--prefill-pool-tokens", "16384")
    prefills, decodes = start_servers(
        logs,
        {"small": ("placeholder", *TENANT_KEYS), "roomy": ("reject", *roomy, *TENANT_KEYS)},
        {"d0": TENANT_KEYS, "d1": TENANT_KEYS},
    )
    try:
        yield Fleet(prefills, decodes, logs)
    finally:
        stop_servers(prefills, decodes)


def node(role: str, url: str) -> str:
    return f"{role}-{url.removeprefix('http://').replace(':', '-')}"


def path_of(fleet: Fleet, prefill: str, decode: str) -> str:
    """The node name kvcanary gives the path (prefill, decode)."""
    return path_name(node("prefill", fleet.prefills[prefill].url), node("decode", fleet.decodes[decode].url))


def watch(served: Callable[..., Served], gateway_url: str, gateway_metrics: str | None = None) -> Served:
    target = reference_target(
        "glm",
        gateway_url,
        sglang_router=gateway_url,
        sglang_router_metrics=gateway_metrics,
        discovery_interval_seconds=1.0,
        credential_hosts=["127.0.0.1"],  # the servers the gateway lists: the tests' own, which take keys
        probes=["canary", "boundary"],
        probe_intervals={"canary": INTERVAL, "boundary": INTERVAL},
        timeout_seconds=INTERVAL,
    )
    return served({"targets": [target], "scheduler": {"jitter_seconds": 0.1}}).start()


def last_results(monitor: Served, path: str) -> list[dict[str, Any]]:
    found = monitor.get("/api/v1/probe-results", target="glm", node=path, limit=20)
    assert found.status_code == 200, found.text
    return list(found.json()["items"])


def verdicts(monitor: Served, path: str) -> dict[str, str]:
    """The latest verdict of each kind down ``path``."""
    latest: dict[str, str] = {}
    for row in last_results(monitor, path):  # newest first
        latest.setdefault(row["probe"], row["verdict"])
    return latest


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_every_path_is_probed_the_leaking_pair_named_and_the_healthy_pairs_pass(
    fleet: Fleet, served: Callable[..., Served], policy: str
) -> None:
    from tests.workers.test_pd_gateway import start_gateway

    gateway = start_gateway(
        fleet.logs, list(fleet.prefills.values()), list(fleet.decodes.values()), policy=policy
    )
    try:
        monitor = watch(served, gateway.url, gateway.metrics_url)
        began = time.monotonic()  # the monitor serving: its discovery's first tick is due
        paths = {(p, d): path_of(fleet, p, d) for p in ("small", "roomy") for d in ("d0", "d1")}

        def all_judged() -> dict[tuple[str, str], dict[str, str]] | None:
            seen = {pair: verdicts(monitor, name) for pair, name in paths.items()}
            done = all(set(v) == {"canary", "boundary"} for v in seen.values())
            return seen if done else None

        seen = monitor.wait_for("a run of both kinds down each of the four paths", all_judged, timeout=90)
        took = time.monotonic() - began
        for decode in ("d0", "d1"):
            assert seen[("small", decode)]["boundary"] in ("leak", "mismatch"), seen
            rows = last_results(monitor, paths[("roomy", decode)])
            why = [(r["probe"], r["reason"], r["detail"]) for r in rows]
            assert seen[("roomy", decode)] == {"canary": "pass", "boundary": "pass"}, why
        # Found within a discovery interval (1 s), then judged at the kinds' next phase (within an
        # interval) once a run is over (within its timeout, an interval), and a loaded host's slack.
        print(f"{policy}: the four paths judged {took:.1f}s after the monitor was serving")
        assert took < 1 + 2 * INTERVAL + 5, took

        # And judged once per interval: each path's next run of a kind starts an interval after its first.
        def second_runs() -> dict[str, float] | None:
            gaps = {}
            for name in paths.values():
                runs = [r for r in last_results(monitor, name) if r["probe"] == "canary"]
                starts = sorted(datetime.fromisoformat(r["started_at"]).timestamp() for r in runs)
                if len(starts) < 2:
                    return None
                gaps[name] = starts[1] - starts[0]
            return gaps

        gaps = monitor.wait_for("a second run down each path", second_runs, timeout=2 * INTERVAL + 30)
        assert all(gap < INTERVAL + 5 for gap in gaps.values()), gaps

        small_paths = {paths[("small", "d0")], paths[("small", "d1")]}
        incidents = monitor.get("/api/v1/incidents", target="glm", state="open").json()["items"]
        named = {i["node"] for i in incidents if i["probe"] == "boundary"}
        assert named == small_paths, incidents
        # The targets API names them too, beside the node each kind ran on last: a path, or the target
        # itself through the gateway (node ""), which a run of the kind covers beside its paths (which
        # of them started last is the machine's pace); either way a result on record.
        [entry] = [t for t in monitor.get("/api/v1/targets").json()["items"] if t["name"] == "glm"]
        assert {i["node"] for i in entry["open_incidents"] if i["probe"] == "boundary"} == small_paths, entry
        last = entry["last_verdicts"]["boundary"]
        assert last["node"] in {"", *paths.values()}, entry
        found = monitor.get("/api/v1/probe-results", target="glm", probe="boundary", limit=200)
        recorded = found.json()["items"]
        assert any(
            (r["node"], r["started_at"], r["verdict"]) == (last["node"], last["started_at"], last["verdict"])
            for r in recorded
        ), (last, recorded[:8])
        evidence = [r["evidence"] for r in last_results(monitor, paths[("small", "d1")])
                    if r["probe"] == "boundary" and r["verdict"] != "pass"]  # fmt: skip
        expected = {"prefill": node("prefill", fleet.prefills["small"].url),
                    "decode": node("decode", fleet.decodes["d1"].url)}  # fmt: skip
        assert evidence and evidence[0]["path"] == expected

        # The gateway's circuit breakers, as the monitor read them off its metrics page, by node:
        # what the gateway's page says of each worker's URL, for all four nodes.
        def breakers_agree() -> dict[str, float] | None:
            own = parse_samples(httpx.get(gateway.metrics_url, timeout=5).text)
            theirs = {
                node(role, server.url): own.get(f'smg_worker_cb_state{{worker="{server.url}"}}')
                for role, servers in (("prefill", fleet.prefills), ("decode", fleet.decodes))
                for server in servers.values()
            }
            read = {
                labels["node"]: v for labels, v in monitor.samples("kvcanary_gateway_worker_circuit_state")
            }
            return read if read == theirs else None

        read = monitor.wait_for("the breakers as the gateway's page says", breakers_agree, timeout=15)
        assert len(read) == 4 and set(read.values()) <= {0.0, 1.0, 2.0}, read

        samples = monitor.samples("kvcanary_path_last_judged_timestamp")
        judged = {(labels["prefill"], labels["decode"]): value for labels, value in samples}
        assert len(judged) == 4 and all(time.time() - v < 3 * INTERVAL for v in judged.values()), judged
        # The gateway lists each prefill node's bootstrap port: no pair is left unprobed.
        unprobed = {labels["reason"]: v for labels, v in monitor.samples("kvcanary_paths_unprobed")}
        assert unprobed == {
            "no_bootstrap_port": 0.0,
            "over_max_paths": 0.0,
            "credential_out_of_scope": 0.0,
        }, unprobed
    finally:
        stop_processes([gateway.proc])


@pytest.mark.slow  # the alert's `for` is waited out: over 2 minutes
def test_a_stopped_decode_node_leaves_its_paths_unjudged_and_the_rule_names_them(
    fleet: Fleet, served: Callable[..., Served], tmp_path: Path
) -> None:
    from tests.workers.test_pd_gateway import start_gateway

    # Health checked every second, a node unhealthy at its first failed check: the gateway's view of
    # the stopped node changes within seconds, and the monitor exports it beside its own.
    quick_health = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1")
    gateway = start_gateway(
        fleet.logs, list(fleet.prefills.values()), list(fleet.decodes.values()), more=quick_health
    )
    prometheus = None
    try:
        monitor = watch(served, gateway.url)
        names = [path_of(fleet, p, d) for p in ("small", "roomy") for d in ("d0", "d1")]
        judged = lambda: all(verdicts(monitor, n) for n in names)  # noqa: E731
        monitor.wait_for("the four paths judged", judged, timeout=90)
        scraped = {"kvcanary": [monitor.url.removeprefix("http://")]}
        prometheus = start_prometheus(tmp_path / "prometheus", scraped, rule_files=[RULES])
        stop_process(fleet.decodes["d1"].proc)  # the last test of the module: its fleet goes next
        rule = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                    if r.get("alert") == "KVCanaryPathNotJudged")  # fmt: skip
        stale_node = node("decode", fleet.decodes["d1"].url)
        prefills = {node("prefill", p.url) for p in fleet.prefills.values()}

        def firing() -> set[tuple[str, str]] | None:
            found = {(s["metric"]["prefill"], s["metric"]["decode"]) for s in prometheus.query(rule["expr"])}
            return found or None

        # The stopped node's two paths are the first the rule names. (Not that the live node's stay
        # fresh for good: one run of a kind covers the gateway and every path, and through a gateway
        # retrying a dead node a loaded host's run can outlast 3 intervals.)
        # Both of its paths: each goes stale 3 intervals after its own last judgement, a moment apart.
        expected = {(prefill, stale_node) for prefill in prefills}
        both = lambda: (found := firing()) is not None and expected <= found and found  # noqa: E731
        stale = monitor.wait_for("the rule to name both stale paths", both, timeout=6 * INTERVAL + 30)
        assert stale == expected, stale
        # What the gateway says of its nodes, as the monitor read it: only the stopped one unhealthy.
        said = {labels["node"]: value for labels, value in monitor.samples("kvcanary_gateway_worker_healthy")}
        live = {node("decode", fleet.decodes["d0"].url), *prefills}
        assert said == {stale_node: 0.0, **dict.fromkeys(live, 1.0)}, said

        # And the alert itself fires in Prometheus, for both stale paths, once its `for` has passed
        # (2 minutes of the expression holding): what an operator is paged by, its runbook named.
        def alerts_firing() -> dict[tuple[str, str], dict[str, Any]] | None:
            ours = [a for a in prometheus.alerts() if a["labels"]["alertname"] == "KVCanaryPathNotJudged"]
            fired = {
                (a["labels"]["prefill"], a["labels"]["decode"]): a for a in ours if a["state"] == "firing"
            }
            return fired if expected <= fired.keys() else None

        hold = int(rule["for"][:-1]) * {"s": 1, "m": 60, "h": 3600}[rule["for"][-1]]
        fired = monitor.wait_for("the alert firing for both", alerts_firing, timeout=hold + 2 * INTERVAL + 30)
        assert fired.keys() == expected, sorted(fired)
        for (prefill, decode), alert in fired.items():
            assert alert["labels"]["severity"] == "warning"
            assert f"{prefill} → {decode}" in alert["annotations"]["summary"], alert["annotations"]
            runbook = alert["annotations"]["runbook_url"].split("/blob/main/", 1)[1]
            assert (REPO / runbook).is_file(), runbook
    finally:
        if prometheus is not None:
            prometheus.stop()
        stop_processes([gateway.proc])
