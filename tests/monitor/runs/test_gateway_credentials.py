"""No tenant key reaches an address the operator did not name, behind the real gateway.

SGLang's model gateway (sglang-router 0.3.2, PD mode) lists, besides the operator's own prefill and
decode servers (reference servers on 127.0.0.1, which take the tenants' keys and a worker
credential), workers at an address nobody named: 127.0.0.2 (loopback on Linux, like all of
127.0.0.0/8). Two of them are sound reference servers that take no key; two are hosts that answer
nothing without a key. Every one of them is a recording host (``tests/monitor/targets/
recording_host.py``): the requests it gets, their headers, are kept, and the sound ones are passed
on to their server. ``kvcanary serve`` watches the target with ``credential_hosts: [127.0.0.1]``.

Over several intervals the hosts on 127.0.0.2 get no request carrying any key: completions down
both legs, ``/tokenize``, server info, the join-time question whether they take requests without
one. The sound ones are probed without a key and pass; the pairs of the refusing ones are counted
as ``kvcanary_paths_unprobed{reason="credential_out_of_scope"}`` and logged; the operator's own
servers get the tenants' keys, or the worker credential where the target states one, and the
rotated credential file is taken up on SIGHUP.

The gateway forwards each request's ``Authorization`` to the worker it picks (seen with 0.3.2): so
the target's base URL is a second gateway, in front of the operator's servers only, and the
gateway kvcanary reads its nodes from lists recording hosts in front of them. What reaches a
recording host is then what kvcanary itself sent.

Needs the gateway's venv (``scripts/setup-sglang-router.sh``): skipped without it, failed under
``KVCANARY_REQUIRE_SGLANG_ROUTER=1``.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import path_name
from kvcanary.monitor.runs.discovery import GatewayDiscovery
from kvcanary.monitor.targets.http import HttpClient
from kvcanary.monitor.targets.openai_format import Limits
from kvcanary.processes import free_port, stop_processes
from tests.monitor.served import Served, reference_target
from tests.monitor.targets.recording_host import ROGUE_HOST, RecordingHost, Seen, refuse_without_key
from tests.probes.probe_harness import KEYS
from tests.support import REPO, WorkerProcess, wait_worker
from tests.support.loopback import Loopback
from tests.workers.pd_support import PrefillServer, start_servers, stop_servers

TENANTS = ("alice", "bob")
TENANT_KEYS = tuple(arg for tenant in TENANTS for arg in ("--api-key", f"{KEYS[tenant]}={tenant}"))
WORKER_KEYS = ("sk-kvcanary-workers-0001", "sk-kvcanary-workers-0002")
WORKER_FLAGS = tuple(arg for key in WORKER_KEYS for arg in ("--api-key", f"{key}=kvcanary-workers"))
#: The reference servers' sizes without pd_support's keys: the rogue ones take none.
KEYLESS = ("--page-size", "16", "--context-window", "8192", "--max-batch", "16")
INTERVAL = 8.0
#: Where the canary's completions go (it asks in chat form).
CHAT = "/v1/chat/completions"


# --- discovery asks each node it finds, once, whether it takes requests without a key ----------------


def joined(discovery: GatewayDiscovery) -> list[str]:
    """The nodes target glm's gateway readings have taken up so far."""
    return [node.name for node in discovery.found.get("glm", [])]


def test_a_found_node_is_asked_once_without_a_key_and_one_outside_the_scope_that_refuses_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answering = RecordingHost(handler=_models)
    refusing = RecordingHost(handler=refuse_without_key)
    allowed = RecordingHost(host="127.0.0.1", handler=refuse_without_key)
    workers = {
        "workers": [
            {"url": answering.url, "worker_type": "decode"},
            {"url": refusing.url, "worker_type": "prefill", "bootstrap_port": 8998},
            {"url": allowed.url, "worker_type": "decode"},
        ]
    }
    gateway = Loopback(lambda request: httpx.Response(200, json=workers))
    try:
        target = reference_target(
            "glm", gateway.url, sglang_router=gateway.url, discovery_interval_seconds=0.05,
            credential_hosts=["127.0.0.1"], probes=["canary"],
        )  # fmt: skip
        settings = Settings.model_validate({"database_url": "sqlite:///unused.db", "targets": [target]})

        async def read_twice() -> GatewayDiscovery:
            http = HttpClient(4)
            discovery = GatewayDiscovery(settings, http, Limits())
            try:
                # A reading and its join-time questions finish at the machine's pace: read until
                # all three joined (a refresh waits half a second, a join a second, then go on).
                deadline = time.monotonic() + 30
                while len(joined(discovery)) < 3 and time.monotonic() < deadline:
                    await discovery.refresh()
                    await asyncio.sleep(0.1)
                await discovery.refresh()  # the same nodes: nobody asked again
            finally:
                await http.aclose()
            return discovery

        with caplog.at_level("WARNING", logger="kvcanary.discovery"):
            discovery = asyncio.run(read_twice())
        merged = discovery.merged().target("glm")
        assert merged is not None
        marks = {node.info_url: (node.discovered, node.refuses_without_key) for node in merged.nodes}
        assert marks == {answering.url: (True, False), refusing.url: (True, True), allowed.url: (True, True)}
        assert merged.shut_out() == {n.name for n in merged.nodes if n.info_url == refusing.url}
        for host in (answering, refusing, allowed):  # once each, and discovery sends no key at all
            assert len(host.requests("/v1/models")) == 1 and keys(host.requests()) == {None}
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "outside the credential scope, refuses requests without a key" in said[0]
    finally:
        for server in (gateway, answering, refusing, allowed):
            server.close()


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "kvcanary-reference"}]})


# --- end to end: kvcanary serve, the real gateway, hosts nobody named -------------------------------


@dataclass
class Listed:
    """A worker as the gateway is told of it: the recording host's URL, and a prefill's bootstrap port."""

    url: str
    bootstrap_port: int = 0


@dataclass
class Fleet:
    """The two gateways and the recording hosts, by name."""

    #: The base URL: a gateway in front of the operator's two servers themselves.
    base: str
    #: The gateway kvcanary reads its nodes from: every recording host.
    listing: str
    #: Recording hosts by name: own-p, own-d (127.0.0.1), rogue-p, rogue-d (sound, 127.0.0.2),
    #: refusing-p, refusing-d (127.0.0.2).
    hosts: dict[str, RecordingHost]

    def node(self, name: str) -> str:
        role = "prefill" if name.endswith("-p") else "decode"
        return f"{role}-{self.hosts[name].url.removeprefix('http://').replace(':', '-')}"

    def path(self, prefill: str, decode: str) -> str:
        return path_name(self.node(prefill), self.node(decode))

    def forget(self) -> None:
        for host in self.hosts.values():
            host.seen.clear()


def launch_rogue(flags: list[str], logs: Path) -> WorkerProcess:
    """Start a reference server bound to 127.0.0.2 (its bootstrap listener too) with ``flags``."""
    port = free_port()
    log = logs / f"rogue-{port}.log"
    argv = [sys.executable, "-m", "kvcanary.workers", "--host", ROGUE_HOST, "--port", str(port),
            "--device", "cpu"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*argv, *flags], stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
    return WorkerProcess(f"http://{ROGUE_HOST}:{port}", port, flags, proc, log)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from tests.workers.test_pd_gateway import need_router, start_gateway

    need_router()
    logs = tmp_path_factory.mktemp("gateway-credentials")
    rogue_bootstrap = free_port()
    rogue_p = launch_rogue(["--mode", "prefill", "--bootstrap-port", str(rogue_bootstrap), "--admission",
                            "reject", "--prefill-pool-tokens", "1024", *KEYLESS], logs)  # fmt: skip
    rogue_d = launch_rogue(["--mode", "decode", "--decode-pool-tokens", "4096", *KEYLESS], logs)
    own = {"own-p": ("reject", *TENANT_KEYS, *WORKER_FLAGS)}
    prefills: dict[str, PrefillServer] = {}
    decodes: dict[str, WorkerProcess] = {}
    hosts: dict[str, RecordingHost] = {}
    gateways: list[subprocess.Popen[bytes]] = []
    try:
        prefills, decodes = start_servers(logs, own, {"own-d": (*TENANT_KEYS, *WORKER_FLAGS)})
        for rogue in (rogue_p, rogue_d):
            wait_worker(rogue)
        hosts = {
            "own-p": RecordingHost(host="127.0.0.1", upstream=prefills["own-p"].url),
            "own-d": RecordingHost(host="127.0.0.1", upstream=decodes["own-d"].url),
            "rogue-p": RecordingHost(upstream=rogue_p.url),
            "rogue-d": RecordingHost(upstream=rogue_d.url),
            "refusing-p": RecordingHost(handler=refuse_without_key),
            "refusing-d": RecordingHost(handler=refuse_without_key),
        }
        bootstrap = {
            "own-p": prefills["own-p"].bootstrap_port,
            "rogue-p": rogue_bootstrap,
            "refusing-p": free_port(),
        }
        base = start_gateway(logs, list(prefills.values()), list(decodes.values()))
        gateways.append(base.proc)
        listing = start_gateway(
            logs,
            [Listed(hosts[name].url, port) for name, port in bootstrap.items()],
            [Listed(hosts[name].url) for name in ("own-d", "rogue-d", "refusing-d")],
        )
        gateways.append(listing.proc)
        yield Fleet(base.url, listing.url, hosts)
    finally:
        stop_processes([*gateways, rogue_p.proc, rogue_d.proc])
        stop_servers(prefills, decodes)
        for host in hosts.values():
            host.close()


def watch(served: Callable[..., Served], fleet: Fleet, **fields: Any) -> Served:
    target = reference_target(
        "glm",
        fleet.base,
        sglang_router=fleet.listing,
        discovery_interval_seconds=1.0,
        credential_hosts=["127.0.0.1"],
        probes=["canary", "capacity"],
        probe_intervals={"canary": INTERVAL, "capacity": 3600},  # capacity: once, when a node joins
        timeout_seconds=INTERVAL,
        **fields,
    )
    return served({"targets": [target], "scheduler": {"jitter_seconds": 0.1}})


#: The pairs kvcanary can probe: the refusing hosts' five are out of reach without a key.
PROBED = [("own-p", "own-d"), ("own-p", "rogue-d"), ("rogue-p", "own-d"), ("rogue-p", "rogue-d")]


def canary_runs(monitor: Served, path: str) -> list[dict[str, Any]]:
    found = monitor.get("/api/v1/probe-results", target="glm", probe="canary", node=path, limit=20)
    assert found.status_code == 200, found.text
    return list(found.json()["items"])


def wait_judged(monitor: Served, fleet: Fleet, runs: int) -> dict[str, list[str]]:
    """Wait until each probed pair has ``runs`` canary verdicts; return them by path.

    A run whose request timed out judged nothing (a loaded machine, the hosts' first answers): it is
    left out. A key refused, or any other answer, is a verdict and counts."""

    def judged() -> dict[str, list[str]] | None:
        seen = {
            fleet.path(p, d): [
                r["verdict"]
                for r in canary_runs(monitor, fleet.path(p, d))
                if (r["verdict"], r["reason"]) != ("error", "timeout")
            ]
            for p, d in PROBED
        }
        return seen if all(len(v) >= runs for v in seen.values()) else None

    return monitor.wait_for(f"{runs} canary runs down each pair", judged, timeout=runs * INTERVAL + 60)


def keys(requests: list[Seen], *paths: str) -> set[str | None]:
    """The ``Authorization`` headers of ``requests`` (to ``paths`` only, when given)."""
    return {seen.authorization for seen in requests if not paths or seen.path in paths}


def ours(host: RecordingHost) -> list[Seen]:
    """The requests kvcanary itself sent the host (its agent), not the listing gateway's health checks."""
    return [seen for seen in host.requests() if seen.headers.get("user-agent") == "kvcanary"]


def test_no_key_reaches_hosts_nobody_named_and_their_pairs_are_probed_without_one_or_counted(
    fleet: Fleet, served: Callable[..., Served]
) -> None:
    fleet.forget()
    monitor = watch(served, fleet).start()
    verdicts = wait_judged(monitor, fleet, runs=3)
    assert all(set(v) == {"pass"} for v in verdicts.values()), verdicts

    unprobed = {labels["reason"]: v for labels, v in monitor.samples("kvcanary_paths_unprobed")}
    assert unprobed == {"no_bootstrap_port": 0.0, "over_max_paths": 0.0, "credential_out_of_scope": 5.0}
    covered = {
        (labels["prefill"], labels["decode"])
        for labels, _ in monitor.samples("kvcanary_path_last_judged_timestamp")
    }
    assert covered == {(fleet.node(p), fleet.node(d)) for p, d in PROBED}
    log = monitor.log()
    assert "5 prefill x decode pair(s) not probed (credential_out_of_scope)" in log
    for name in ("refusing-p", "refusing-d"):
        assert (
            f"node {fleet.node(name)}, listed by gateway {fleet.listing} outside the credential scope" in log
        )

    rogue = {
        name: fleet.hosts[name].requests() for name in ("rogue-p", "rogue-d", "refusing-p", "refusing-d")
    }
    # What each was sent: completions down both legs and the prefill's token count (the sound
    # ones), server info for the capacity audit and the join-time question (all four).
    asked = {name: {seen.path for seen in requests} for name, requests in rogue.items()}
    assert {CHAT, "/tokenize", "/v1/models", "/server_info"} <= asked["rogue-p"], asked
    assert {CHAT, "/v1/models", "/server_info"} <= asked["rogue-d"], asked
    assert all({"/v1/models", "/server_info"} <= asked[name] for name in ("refusing-p", "refusing-d")), asked
    assert not any(asked[name] & {CHAT, "/tokenize"} for name in ("refusing-p", "refusing-d")), asked
    # And never a key of any kind.
    assert set().union(*(keys(requests) for requests in rogue.values())) == {None}

    # The operator's own servers got the tenants' keys: each its own on a completion, one for lookups.
    tenant_headers = {f"Bearer {KEYS[tenant]}" for tenant in TENANTS}
    for name in ("own-p", "own-d"):
        assert keys(ours(fleet.hosts[name]), CHAT) == tenant_headers, name
        # The capacity audit's reading (discovery's reading of a node's ranks takes no key at all).
        assert keys(ours(fleet.hosts[name]), "/server_info") - {None} == {f"Bearer {KEYS['alice']}"}, name
    assert keys(ours(fleet.hosts["own-p"]), "/tokenize") == {f"Bearer {KEYS['alice']}"}


def test_a_worker_credential_goes_to_the_operators_servers_and_a_rotated_one_is_taken_up_on_reload(
    fleet: Fleet, served: Callable[..., Served], tmp_path: Path
) -> None:
    fleet.forget()
    credential = tmp_path / "worker-key"
    credential.write_text(WORKER_KEYS[0] + "\n")
    monitor = watch(served, fleet, worker_api_key_file=str(credential)).start()
    verdicts = wait_judged(monitor, fleet, runs=2)
    assert all(set(v) == {"pass"} for v in verdicts.values()), verdicts
    own = [*ours(fleet.hosts["own-p"]), *ours(fleet.hosts["own-d"])]
    # Every request kvcanary sent the servers in scope: the worker credential, never a tenant's.
    assert {CHAT, "/tokenize", "/server_info"} <= {seen.path for seen in own}
    assert keys(own, CHAT, "/tokenize") == {f"Bearer {WORKER_KEYS[0]}"}
    assert keys(own, "/server_info") - {None} == {f"Bearer {WORKER_KEYS[0]}"}

    credential.write_text(WORKER_KEYS[1] + "\n")
    monitor.signal(signal.SIGHUP)
    monitor.wait_for("the reload", lambda: "(SIGHUP): 1 changed target(s)" in monitor.log(), timeout=15)
    rotated = f"Bearer {WORKER_KEYS[1]}"
    monitor.wait_for(
        "the rotated credential on a completion",
        lambda: rotated in keys(fleet.hosts["own-d"].requests(), CHAT),
        timeout=2 * INTERVAL + 15,
    )
    since = len(fleet.hosts["own-d"].seen)
    after_rotation = lambda: fleet.hosts["own-d"].requests()[since:]  # noqa: E731
    monitor.wait_for("a run after", lambda: keys(after_rotation(), CHAT), timeout=2 * INTERVAL + 15)
    assert keys(after_rotation(), CHAT) == {rotated}
    rogue = [
        seen
        for name in ("rogue-p", "rogue-d", "refusing-p", "refusing-d")
        for seen in fleet.hosts[name].requests()
    ]
    assert keys(rogue) == {None}
    assert "sk-kvcanary-workers" not in monitor.log()
