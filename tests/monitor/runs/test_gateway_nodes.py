"""Nodes found from SGLang's model gateway: ``GET /workers`` read, merged and followed; each node audited.

The unit tests read a ``GET /workers`` answer recorded from the real gateway (sglang-router 0.3.2 in
``--pd-disaggregation`` mode with two prefill and two decode reference servers:
``tests/fixtures/engines/sglang-router-0.3.2-pd-workers.json``) and hostile variants of it served on
a loopback socket.

The end-to-end tests run ``kvcanary serve`` given only the gateway's URL, in front of the incident's
topology: two prefill servers (one with the incident's small pool, below the context window) and
two decode servers, plus a third prefill server the test registers and removes with the gateway's
own ``POST /workers`` and ``DELETE /workers/{id}``. They need the gateway's venv (see
``tests/workers/test_pd_gateway.py``): skipped without it, failed under
``KVCANARY_REQUIRE_SGLANG_ROUTER=1``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from unittest.mock import patch

import httpx
import pytest

from kvcanary.monitor.config.base import NAME_RE
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.runs import discovery as discovery_module
from kvcanary.monitor.runs.discovery import GatewayDiscovery, NodeChange
from kvcanary.monitor.targets.http import HttpClient
from kvcanary.monitor.targets.openai_format import Limits
from kvcanary.monitor.targets.sglang_gateway import (
    MAX_WORKERS,
    GatewayUnreadable,
    node_name,
    parse_workers,
    read_circuits,
    read_workers,
    worker_node,
)
from kvcanary.processes import stop_processes
from tests.monitor.served import Served, reference_target
from tests.support import WorkerProcess
from tests.support.loopback import Loopback
from tests.workers.pd_support import PrefillServer, start_servers, stop_servers

RECORDED = (
    Path(__file__).resolve().parents[2] / "fixtures" / "engines" / "sglang-router-0.3.2-pd-workers.json"
)
DISCOVERY_SECONDS = 1.0


def recorded() -> dict[str, Any]:
    return json.loads(RECORDED.read_text())


# --- the /workers answer, as the gateway writes it --------------------------------------------------


def test_the_recorded_answer_is_two_prefill_and_two_decode_nodes_at_their_own_urls() -> None:
    nodes = {node.name: node for node in parse_workers(recorded()).nodes}
    assert sorted(nodes) == [
        "decode-127.0.0.1-44651",
        "decode-127.0.0.1-58277",
        "prefill-127.0.0.1-45295",
        "prefill-127.0.0.1-47219",
    ]
    prefill = nodes["prefill-127.0.0.1-45295"]
    assert (prefill.role, prefill.info_url) == ("prefill", "http://127.0.0.1:45295")
    assert prefill.metrics_url == "http://127.0.0.1:45295/metrics"
    assert nodes["decode-127.0.0.1-58277"].role == "decode"


def test_a_dp_aware_listing_of_ranks_is_one_node_with_as_many_ranks() -> None:
    # sglang-router --dp-aware lists each rank of a server as URL@rank (DPAwareWorkerBuilder).
    answer = recorded()
    prefill = next(w for w in answer["workers"] if w["worker_type"] == "prefill")
    ranks = [{**prefill, "url": f"{prefill['url']}@{rank}"} for rank in range(3)]
    answer["workers"] = [w for w in answer["workers"] if w is not prefill] + ranks
    nodes = {node.name: node for node in parse_workers(answer).nodes}
    assert len(nodes) == 4
    assert nodes[node_name("prefill", prefill["url"])].dp_size == 3
    assert {n.dp_size for name, n in nodes.items() if name != node_name("prefill", prefill["url"])} == {1}


def test_names_are_stable_and_label_safe_whatever_the_gateway_writes() -> None:
    long_host = "a" * 60 + ".example.com"
    answer = {
        "workers": [
            {"url": f"http://{long_host}:30000", "worker_type": "regular"},
            {"url": f"http://{long_host}:30001", "worker_type": "regular"},
            {"url": "http://[::1]:8000", "worker_type": "decode"},
            {"url": "http://10.0.0.7:30000@0", "worker_type": "prefill"},  # data-parallel ranks:
            {"url": "http://10.0.0.7:30000@1", "worker_type": "prefill"},  # one server, one node
        ]
    }
    first, again = parse_workers(answer).nodes, parse_workers(answer).nodes
    assert [n.name for n in first] == [n.name for n in again]
    assert all(NAME_RE.match(node.name) for node in first), [n.name for n in first]
    assert len({node.name for node in first}) == 4  # the two long names stay apart
    assert first[0].role == "aggregated" and first[0].name.startswith("aggregated-aaaa")
    assert first[3].info_url == "http://10.0.0.7:30000"


def test_what_the_gateway_says_of_each_nodes_health_is_kept_by_node_name() -> None:
    answer = recorded()
    assert set(parse_workers(answer).healthy.values()) == {True}  # all four healthy when recorded
    answer["workers"][0]["is_healthy"] = False
    answer["workers"][1]["is_healthy"] = "yes"  # not a bool: nothing said
    found = parse_workers(answer)
    first, second = (worker_node(w) for w in answer["workers"][:2])
    assert first is not None and second is not None
    assert found.healthy[first.name] is False and second.name not in found.healthy
    assert len(found.healthy) == 3


def test_workers_that_cannot_be_read_are_left_out_and_counted() -> None:
    good = recorded()["workers"][0]
    answer = {
        "workers": [
            good,
            {**good, "url": "ftp://127.0.0.1:1"},
            {**good, "url": "http://user:secret@127.0.0.1:1"},
            {**good, "worker_type": "router"},
            {**good, "url": 42},
            "not a worker",
        ]
    }
    listed = parse_workers(answer)
    assert [node.info_url for node in listed.nodes] == [good["url"]] and listed.skipped == 5


def test_a_gateway_listing_more_workers_than_the_bound_is_cut() -> None:
    many = [{"url": f"http://10.0.{i // 250}.{i % 250}:30000", "worker_type": "decode"} for i in range(1500)]
    listed = parse_workers({"workers": many})
    assert len(listed.nodes) == MAX_WORKERS and listed.skipped == 500


@pytest.mark.parametrize("answer", [[], {"workers": "none"}, {"total": 0}, None])
def test_an_answer_without_a_worker_list_is_unreadable(answer: Any) -> None:
    with pytest.raises(GatewayUnreadable, match="no 'workers' list"):
        parse_workers(answer)


def over_loopback(handler: Callable[[httpx.Request], httpx.Response], read: Callable[..., Any]) -> Any:
    """Run ``read(http, url)`` against ``handler`` served on a loopback socket."""
    gateway = Loopback(handler)
    try:

        async def go() -> Any:
            http = HttpClient(4)
            try:
                return await read(http, gateway.url)
            finally:
                await http.aclose()

        return asyncio.run(go())
    finally:
        gateway.close()


def read_from(handler: Callable[[httpx.Request], httpx.Response], limits: Limits = Limits()) -> Any:
    return over_loopback(handler, lambda http, url: read_workers(http, url, 5.0, limits))


def test_the_answer_is_read_over_the_network_and_bounded_in_size() -> None:
    body = RECORDED.read_bytes()
    listed = read_from(lambda request: httpx.Response(200, content=body))
    assert len(listed.nodes) == 4
    with pytest.raises(GatewayUnreadable, match="larger than"):
        read_from(lambda request: httpx.Response(200, content=body), Limits(lookup_bytes=len(body) - 1))
    with pytest.raises(GatewayUnreadable, match="HTTP 503"):
        read_from(lambda request: httpx.Response(503, text="busy"))
    with pytest.raises(GatewayUnreadable, match="not JSON"):
        read_from(lambda request: httpx.Response(200, text="<html>"))


def circuits_from(page: str, status: int = 200) -> dict[str, int]:
    """The breakers read off ``page`` served on loopback, for the recorded answer's four nodes."""
    nodes = parse_workers(recorded()).nodes
    handler = lambda request: httpx.Response(status, text=page)  # noqa: E731
    return over_loopback(
        handler, lambda http, url: read_circuits(http, url + "/metrics", nodes, 5.0, Limits())
    )


def test_the_gateways_breakers_are_read_by_node_a_ranks_worst_and_strangers_left_out() -> None:
    workers = recorded()["workers"]
    prefill, decode = (
        next(w for w in workers if w["worker_type"] == kind)["url"] for kind in ("prefill", "decode")
    )
    page = "\n".join(
        [
            "# TYPE smg_worker_cb_state gauge",
            f'smg_worker_cb_state{{worker="{prefill}"}} 0',
            f'smg_worker_cb_state{{worker="{decode}@0"}} 2',  # one rank half-open, the other open
            f'smg_worker_cb_state{{worker="{decode}@1"}} 1',
            'smg_worker_cb_state{worker="http://10.9.9.9:1"} 1',  # a worker that is no node of ours
            "# TYPE smg_worker_health gauge",
            f'smg_worker_health{{worker="{prefill}"}} 1',
        ]
    )
    read = circuits_from(page + "\n")
    assert read == {worker_node({"worker_type": "prefill", "url": prefill}).name: 0,  # type: ignore[union-attr]
                    worker_node({"worker_type": "decode", "url": decode}).name: 1}  # type: ignore[union-attr]  # fmt: skip
    with pytest.raises(GatewayUnreadable, match="HTTP 404"):
        circuits_from("no page", status=404)
    with pytest.raises(GatewayUnreadable, match="not a Prometheus page") as unreadable:
        circuits_from('smg_worker_cb_state{worker="a",forged\x1b[2J 1\n')  # the parser quotes that
    assert "forged" not in str(unreadable.value) and "\x1b" not in str(unreadable.value)  # none of the page


# --- merging into a target's nodes --------------------------------------------------------------------


INTERVAL = 0.05


def gateway_settings(url: str, nodes: list[dict[str, str]] | None = None) -> Settings:
    target = reference_target(
        "glm",
        url,
        sglang_router=url,
        nodes=nodes or [],
        probes=["capacity"],
        discovery_interval_seconds=INTERVAL,
    )
    return Settings.model_validate({"database_url": "sqlite:///unused.db", "targets": [target]})


def test_a_gateway_target_has_no_node_until_the_gateway_lists_one() -> None:
    settings = gateway_settings("http://gw.test:30000/")
    target = settings.target("glm")
    assert target is not None and target.sglang_router == "http://gw.test:30000"
    assert target.node_list() == []  # not the gateway itself, audited as if it were an engine
    plain = TargetConfig.model_validate(reference_target("plain", "http://gw.test:30000"))
    assert [node.info_url for node in plain.node_list()] == ["http://gw.test:30000"]
    with pytest.raises(ValueError, match="credentials"):
        TargetConfig.model_validate(reference_target("t", "http://x", sglang_router="http://u:p@gw:1"))


def discovered(
    answers: list[httpx.Response], nodes: list[dict[str, str]] | None = None
) -> tuple[GatewayDiscovery, list[dict[str, NodeChange]], str]:
    """Return a discovery of target glm after one reading per answer of a gateway that gives
    ``answers`` in turn, what each reading changed, and the gateway's URL."""
    given = iter(answers)
    gateway = Loopback(lambda request: next(given))
    try:
        http = HttpClient(4)
        discovery = GatewayDiscovery(gateway_settings(gateway.url, nodes), http, Limits())

        async def read() -> list[dict[str, NodeChange]]:
            changes = []
            try:
                for _ in answers:
                    changes.append(await discovery.refresh())
                    await asyncio.sleep(2 * INTERVAL)  # the next reading is due
            finally:
                await http.aclose()
            return changes

        # Each call takes up its own reading: a refresh that gave up on a reading a loaded machine
        # had not finished would hand it to the next call, which starts none of its own.
        with patch.object(discovery_module, "ROUND_WAIT_SECONDS", 30):
            return discovery, asyncio.run(read()), gateway.url
    finally:
        gateway.close()


def test_found_nodes_follow_the_listed_ones_and_a_listed_name_wins() -> None:
    listed = {"name": "prefill-127.0.0.1-45295", "role": "prefill", "info_url": "http://10.9.9.9:1"}
    discovery, changes, _ = discovered([httpx.Response(200, content=RECORDED.read_bytes())], [listed])
    assert sorted(changes[0]["glm"].joined) == sorted(n.name for n in parse_workers(recorded()).nodes)
    target = discovery.merged().target("glm")
    assert target is not None
    by_name = {node.name: node for node in target.node_list()}
    assert len(by_name) == 4 and by_name["prefill-127.0.0.1-45295"].info_url == "http://10.9.9.9:1"
    assert target.node_list()[0].name == "prefill-127.0.0.1-45295"  # the listed node first


def test_a_reload_keeps_the_nodes_found_unless_the_target_names_another_gateway() -> None:
    discovery, _, url = discovered([httpx.Response(200, content=RECORDED.read_bytes())])
    kept = discovery.take_up(gateway_settings(url)).target("glm")
    assert kept is not None and len(kept.node_list()) == 4
    moved = discovery.take_up(gateway_settings("http://another-gateway.test:30000")).target("glm")
    assert moved is not None and moved.node_list() == []


def test_an_unreadable_gateway_keeps_the_last_known_nodes_and_an_empty_list_is_believed() -> None:
    body = RECORDED.read_bytes()
    answers = [httpx.Response(200, content=body), httpx.Response(502, text="bad gateway")]
    discovery, changes, _ = discovered(answers)
    target = discovery.merged().target("glm")
    assert changes[1] == {} and target is not None and len(target.node_list()) == 4
    answers = [httpx.Response(200, content=body), httpx.Response(200, json={"workers": []})]
    discovery, changes, _ = discovered(answers)
    assert len(changes[1]["glm"].left) == 4 and changes[1]["glm"].joined == []
    target = discovery.merged().target("glm")
    assert target is not None and target.node_list() == []


# --- end to end: kvcanary serve given only the gateway's URL ---------------------------------------


@dataclass
class Incident:
    gateway: Any  # tests.workers.test_pd_gateway.Gateway
    prefills: dict[str, PrefillServer]
    decodes: dict[str, WorkerProcess]


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Incident]:
    """The incident's topology behind the real gateway; ``spare`` is a prefill server not yet registered."""
    from tests.workers.test_pd_gateway import ROUTER_PYTHON, VENV, start_gateway

    if not (ROUTER_PYTHON.exists() and (VENV / ".kvcanary-setup").exists()):
        message = f"no sglang-router venv at {VENV}: run bash scripts/setup-sglang-router.sh"
        if os.environ.get("KVCANARY_REQUIRE_SGLANG_ROUTER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    logs = tmp_path_factory.mktemp("gateway-nodes")
    roomy = ("--prefill-pool-tokens", "16384")  # twice the 8,192-token window; the default is 1,024
    prefills, decodes = start_servers(
        logs,
        {"small": ("reject",), "fixed": ("reject", *roomy), "spare": ("reject", *roomy)},
        {"d0": (), "d1": ()},
    )
    gateway = None
    try:
        listed = [prefills["small"], prefills["fixed"]]
        gateway = start_gateway(logs, listed, list(decodes.values()))
        yield Incident(gateway, prefills, decodes)
    finally:
        if gateway is not None:
            stop_processes([gateway.proc])
        stop_servers(prefills, decodes)


def name(role: str, url: str) -> str:
    return f"{role}-{url.removeprefix('http://').replace(':', '-')}"


#: The node-scoped kinds: each runs on a node as soon as it joins.
AUDITS = ("capacity", "version", "counters")


def results_of(monitor: Served, node: str, probe: str = "capacity") -> list[dict[str, Any]]:
    found = monitor.get("/api/v1/probe-results", target="glm", probe=probe, node=node)
    assert found.status_code == 200, found.text
    return list(found.json()["items"])


def node_changes(monitor: Served) -> dict[str, float]:
    return {labels["change"]: v for labels, v in monitor.samples("kvcanary_gateway_node_changes_total")}


def watch(served_monitors: Callable[..., Served], gateway_url: str) -> Served:
    target = reference_target(
        "glm",
        gateway_url,
        sglang_router=gateway_url,
        discovery_interval_seconds=DISCOVERY_SECONDS,
        probes=list(AUDITS),
        # An hour apart: every audit seen here was run at once because its node joined.
        probe_intervals=dict.fromkeys(AUDITS, 3600),
    )
    return served_monitors({"targets": [target], "scheduler": {"jitter_seconds": 0.1}}).start()


def test_given_only_the_gateway_every_node_is_found_and_audited_and_one_joins_and_leaves(
    incident: Incident, served: Callable[..., Served]
) -> None:
    monitor = watch(served, incident.gateway.url)
    small, fixed, spare = (incident.prefills[n] for n in ("small", "fixed", "spare"))
    expected = {
        name("prefill", small.url): ("mismatch", "pool_below_context_window"),
        name("prefill", fixed.url): ("pass", "headroom_ok"),
        **{name("decode", d.url): ("pass", "decode_pool_not_judged") for d in incident.decodes.values()},
    }

    def audited() -> dict[str, tuple[str, str]] | None:
        seen = {n: results_of(monitor, n) for n in expected}
        if not all(seen.values()):
            return None
        return {n: (rows[0]["verdict"], rows[0]["reason"]) for n, rows in seen.items()}

    assert monitor.wait_for("a capacity audit of each of the four nodes", audited, timeout=60) == expected
    # Coverage per node: each found node has its series, and an audit judged it within the last minute.
    judged = dict(
        (labels["node"], value) for labels, value in monitor.samples("kvcanary_node_last_judged_timestamp")
    )
    assert set(judged) == set(expected) and all(time.time() - v < 60 for v in judged.values()), judged

    # A reload of the file keeps the nodes found: they are the gateway's, not the file's.
    monitor.config["targets"][0]["timeout_seconds"] = 20
    monitor.write_config()
    monitor.signal()
    monitor.wait_for("the reload", lambda: "(SIGHUP): 1 changed target(s)" in monitor.log(), timeout=15)
    time.sleep(2 * DISCOVERY_SECONDS)
    log = monitor.log()
    assert " left gateway " not in log and log.count(" joined gateway ") == 4, log[-3000:]
    monitor.wait_for("4 joined", lambda: node_changes(monitor) == {"joined": 4.0, "left": 0.0}, 5)

    # A prefill server registered with the gateway at run time is audited within one interval.
    added = httpx.post(
        f"{incident.gateway.url}/workers",
        json={"url": spare.url, "worker_type": "prefill", "bootstrap_port": spare.bootstrap_port},
        timeout=10,
    )
    assert added.status_code == 202, added.text
    worker_id = added.json()["worker_id"]
    listed_at = wait_listed(incident.gateway.url, spare.url, present=True)
    joined = name("prefill", spare.url)

    def audits() -> dict[str, dict[str, Any]] | None:
        rows = {kind: results_of(monitor, joined, kind) for kind in AUDITS}
        return {kind: found[0] for kind, found in rows.items()} if all(rows.values()) else None

    first = monitor.wait_for("the added node's audits", audits, timeout=30)
    assert (first["capacity"]["verdict"], first["capacity"]["reason"]) == ("pass", "headroom_ok")
    assert {kind: row["verdict"] for kind, row in first.items()} == dict.fromkeys(AUDITS, "pass"), first
    for kind, row in first.items():
        took = datetime.fromisoformat(row["started_at"]).timestamp() - listed_at
        # One interval until the next reading, and slack for a loaded machine's scheduler (the join's
        # own reads of the node wait up to a second each); the audits' own interval is an hour.
        assert took < DISCOVERY_SECONDS + 10, (
            f"{kind} ran {took:.1f}s after the gateway listed it\n{monitor.log()[-3000:]}"
        )
    monitor.wait_for("5 joined", lambda: node_changes(monitor) == {"joined": 5.0, "left": 0.0}, 5)

    # One removed from the gateway is dropped from the target, and the monitor says so.
    removed = httpx.delete(f"{incident.gateway.url}/workers/{worker_id}", timeout=10)
    assert removed.status_code == 202, removed.text
    wait_listed(incident.gateway.url, spare.url, present=False)
    said = f"node {joined} left gateway {incident.gateway.url}"
    monitor.wait_for("the log to say the node left", lambda: said in monitor.log(), timeout=15)
    monitor.wait_for("1 left", lambda: node_changes(monitor) == {"joined": 5.0, "left": 1.0}, 5)

    def pools_exported() -> set[str] | None:
        nodes = {labels["node"] for labels, _ in monitor.samples("kvcanary_node_kv_pool_tokens")}
        return nodes if nodes == set(expected) else None  # re-audited without the node that left

    monitor.wait_for("the pools of the four remaining nodes only", pools_exported, timeout=15)
    covered = {labels["node"] for labels, _ in monitor.samples("kvcanary_node_last_judged_timestamp")}
    assert covered == set(expected), covered  # the node that left has no coverage series left
    count = len(results_of(monitor, joined))
    time.sleep(3 * DISCOVERY_SECONDS)
    assert len(results_of(monitor, joined)) == count  # no longer audited


def wait_listed(gateway: str, url: str, present: bool, timeout: float = 30) -> float:
    """Wait until the gateway lists (or no longer lists) the worker at ``url``; return when it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = httpx.get(f"{gateway}/workers", timeout=5).json()["workers"]
        if any(w["url"] == url for w in workers) == present:
            return time.time()
        time.sleep(0.1)
    raise AssertionError(f"the gateway did not {'list' if present else 'drop'} {url} in {timeout:.0f}s")
