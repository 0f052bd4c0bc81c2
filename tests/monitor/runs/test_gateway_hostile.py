"""One hostile worker stops nothing: discovery that one node cannot break, guards one node cannot poison.

The unit tests serve gateways and nodes on loopback sockets, each answering as an attacker's host
or a broken engine would: a server info that makes the read raise, a node that answers late, a
worker list and a metrics page that never answer. Every other node of every gateway still joins,
at once; each failure is counted per target, node and read, and logged once.

The end-to-end tests run the real gateway (sglang-router 0.3.2, PD mode) in front of reference
prefill and decode servers, listing beside them two hosts of the test's own: a prefill worker whose
server info says its KV pool holds 16 tokens, and a decode worker at a 2,000-character host name
(the gateway reaches it through a loopback proxy standing in for the attacker's DNS, named in the
gateway's ``http_proxy``; it lists only workers it reached). A second gateway target lists the
reference servers only. Read by discovery, the sound nodes of both gateways join at the first
reading, the far host is refused, said once and counted; the node that says 16 tokens guards
nothing, while the sound prefill node's deployment keeps its own guard, and so does the gateway's.
Then ``kvcanary serve`` watches the gateway while its metrics page answers only after 40 s: a
prefill server registered with the gateway is audited within a few discovery intervals. They need
the gateway's venv: skipped without it, failed under ``KVCANARY_REQUIRE_SGLANG_ROUTER=1``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.containment.guards import AdmissionFacts, GuardFacts
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.runs.discovery import (
    JOIN_WAIT_SECONDS,
    READ_SECONDS,
    ROUND_WAIT_SECONDS,
    GatewayDiscovery,
    NodeChange,
)
from kvcanary.monitor.targets.http import HttpClient
from kvcanary.monitor.targets.openai_format import Limits
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.monitor.targets.sglang_gateway import node_name, parse_workers
from kvcanary.monitor.traffic.facts import TargetFacts
from kvcanary.processes import free_port, stop_processes
from kvcanary.wire import api_base_key
from tests.monitor.runs.test_gateway_nodes import AUDITS, results_of, wait_listed
from tests.monitor.served import Served, reference_target
from tests.monitor.targets.recording_host import RecordingHost
from tests.probes.probe_harness import KEYS, FakeEngine
from tests.support import WorkerProcess
from tests.support.loopback import Loopback
from tests.workers.pd_support import PrefillServer, start_servers, stop_servers
from tests.workers.support import MODEL

INTERVAL = 0.05
#: The read bound of the tests' hung gateways: a discovery call that waited for one took this long.
HUNG = 4.0
FAR_HOST = "a" * 2000


def gateway_target(name: str, url: str, **fields: Any) -> dict[str, Any]:
    fields.setdefault("discovery_interval_seconds", INTERVAL)
    fields.setdefault("probes", ["capacity"])
    return reference_target(name, url, sglang_router=url, **fields)


def settings_of(*targets: dict[str, Any]) -> Settings:
    return Settings.model_validate(
        {
            "database_url": "sqlite:///unused.db",
            "targets": list(targets),
            "containment": {"admission_guard": "enforce"},
        }
    )


def worker(url: str, kind: str = "decode") -> dict[str, Any]:
    return {"url": url, "worker_type": kind, "is_healthy": True}


def listing(*workers: dict[str, Any]) -> Loopback:
    """A gateway that lists ``workers`` at ``GET /workers``."""
    return Loopback(lambda request: httpx.Response(200, json={"workers": list(workers)}))


class Held:
    """A loopback server that answers ``answer`` only once released (or ``after`` seconds)."""

    def __init__(self, answer: httpx.Response, after: float = 3600.0):
        self.released = threading.Event()
        self.asked = 0

        async def hold(request: httpx.Request) -> httpx.Response:
            self.asked += 1
            deadline = time.monotonic() + after
            while not self.released.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return answer

        self.server = Loopback(hold)
        self.url = self.server.url

    def close(self) -> None:
        self.released.set()
        self.server.close()


async def rounds_of(
    discovery: GatewayDiscovery,
    seconds: float,
    pause: float = INTERVAL,
    began: float | None = None,
    done: Callable[[list[tuple[float, dict[str, NodeChange]]]], bool] | None = None,
) -> list[tuple[float, dict[str, NodeChange]]]:
    """Refresh for ``seconds`` (or until ``done`` says so of what was seen); return each call's
    changes and how long after ``began`` (default: now) it returned."""
    began = time.monotonic() if began is None else began
    until = time.monotonic() + seconds
    seen = []
    while time.monotonic() < until:
        changes = await discovery.refresh()
        seen.append((time.monotonic() - began, changes))
        if done is not None and done(seen):
            break
        await asyncio.sleep(pause)
    return seen


def first_changes(seen: list[tuple[float, dict[str, NodeChange]]]) -> dict[str, NodeChange]:
    """Each target's first change: what its first reading taken up moved."""
    first: dict[str, NodeChange] = {}
    for _, changes in seen:
        for target, change in changes.items():
            first.setdefault(target, change)
    return first


def joined_by(seen: list[tuple[float, dict[str, NodeChange]]]) -> dict[str, dict[str, float]]:
    """Each target's joined nodes and when the call that said so returned."""
    joined: dict[str, dict[str, float]] = {}
    for at, changes in seen:
        for target, change in changes.items():
            for node in change.joined:
                joined.setdefault(target, {}).setdefault(node, at)
    return joined


def exported(
    discovery: GatewayDiscovery, facts: TargetFacts | None = None
) -> dict[str, dict[tuple[str, ...], float]]:
    """Discovery's and the facts' series as ``/metrics`` serves them, by name and their label
    values in the order ``LABELS`` names them."""
    metrics = MonitorMetrics(CollectorRegistry())
    untrusted = (lambda: facts.untrusted) if facts is not None else dict
    metrics.watch_gateways(lambda: discovery.health, lambda: discovery.circuits, lambda: discovery, untrusted)
    found: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            values = tuple(sample.labels[label] for label in LABELS.get(sample.name, ()))
            found.setdefault(sample.name, {})[values] = sample.value
    return found


LABELS = {
    "kvcanary_gateway_read_errors_total": ("target", "node", "read"),
    "kvcanary_gateway_workers_refused": ("target", "reason"),
    "kvcanary_node_pool_untrusted": ("target", "node", "reason"),
}


def warnings(caplog: pytest.LogCaptureFixture, *words: str) -> list[str]:
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    return [line for line in said if all(word in line for word in words)]


# --- what the gateway lists ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"http://{FAR_HOST}:30000",
        f"http://{'b' * 64}.example:30000",  # a label DNS cannot hold
        "http://a..b:30000",
        "http://exa mple:30000",
        "http://10.0.0.7:0",
        "http://10.0.0.7:70000",
        f"http://10.0.0.7:30000/{'p' * 600}",
    ],
)
def test_a_worker_at_a_url_no_engine_can_have_is_refused_and_the_rest_taken(url: str) -> None:
    answer = {
        "workers": [worker("http://10.0.0.7:30000"), worker(url), worker("http://[::1]:8000", "prefill")]
    }
    listed = parse_workers(answer)
    assert [node.info_url for node in listed.nodes] == ["http://10.0.0.7:30000", "http://[::1]:8000"]
    assert listed.refused == {"url": 1} and listed.skipped == 1
    assert len(listed.example) < 100  # what reaches the log line of it: plain and short


# --- each node and each gateway on its own ------------------------------------------------------------


def test_a_node_whose_answer_makes_its_read_raise_is_counted_once_and_every_other_node_joins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The hostile node answers its server info with a JSON array nested 100,000 deep, which makes
    the reader raise (RecursionError, no error a read expects). It joins as one rank, its read
    counted and said once; the other nodes of its gateway and another gateway's join at the same
    reading."""
    sound = [Loopback(FakeEngine()) for _ in range(2)]
    hostile = Loopback(lambda request: httpx.Response(200, content=b"[" * 100_000))
    glm = listing(worker(sound[0].url, "prefill"), worker(hostile.url, "prefill"), worker(sound[1].url))
    other = listing(worker(sound[1].url))
    try:
        settings = settings_of(gateway_target("glm", glm.url), gateway_target("other", other.url))

        async def run() -> tuple[GatewayDiscovery, list[tuple[float, dict[str, NodeChange]]]]:
            http = HttpClient(64)
            discovery = GatewayDiscovery(settings, http, Limits())
            try:  # until both gateways' readings were taken up: a loaded machine reads them late
                seen = await rounds_of(discovery, 10 * INTERVAL)
                while {"glm", "other"} - {t for _, changes in seen for t in changes}:
                    assert time.monotonic() < deadline, seen
                    seen += await rounds_of(discovery, INTERVAL)
                return discovery, seen
            finally:
                await http.aclose()

        deadline = time.monotonic() + 30
        discovery, seen = asyncio.run(run())
        bad = node_name("prefill", hostile.url)
        names = [node_name("prefill", sound[0].url), bad, node_name("decode", sound[1].url)]
        # The first reading of each gateway that was taken up: all of glm's nodes join at once.
        first = {t: next(changes[t] for _, changes in seen if t in changes) for t in ("glm", "other")}
        assert sorted(first["glm"].joined) == sorted(names)
        assert first["other"].joined == [node_name("decode", sound[1].url)]
        merged = discovery.merged().target("glm")
        assert merged is not None and {n.name: n.dp_size for n in merged.nodes}[bad] == 1
        assert discovery.failures == {("glm", bad, "server_info"): 1}  # asked once, when it joined
        said = warnings(caplog, bad)
        assert len(said) == 1 and "server_info read failed: RecursionError" in said[0], said
        errors = exported(discovery)["kvcanary_gateway_read_errors_total"]
        assert errors == {("glm", bad, "server_info"): 1.0}
        discovery.take_up(settings_of(gateway_target("other", other.url)))  # a reload removed glm
        assert discovery.failures == {} and "glm" not in discovery.found
    finally:
        for server in (*sound, hostile, glm, other):
            server.close()


def test_a_new_node_slow_to_answer_holds_back_no_other_and_joins_once_it_answers() -> None:
    slow = Held(httpx.Response(200, json={"dp_size": 2}))
    sound = Loopback(FakeEngine())
    gateway = listing(worker(sound.url), worker(slow.url))
    try:
        settings = settings_of(gateway_target("glm", gateway.url))

        async def run() -> tuple[GatewayDiscovery, list[tuple[float, dict[str, NodeChange]]]]:
            http = HttpClient(64)
            discovery = GatewayDiscovery(settings, http, Limits())
            try:
                began = time.monotonic()
                early = await rounds_of(discovery, 2 * JOIN_WAIT_SECONDS + ROUND_WAIT_SECONDS)
                slow.released.set()
                return discovery, early + await rounds_of(discovery, 2 * JOIN_WAIT_SECONDS, began=began)
            finally:
                await http.aclose()

        discovery, seen = asyncio.run(run())
        joined = joined_by(seen)["glm"]
        quick, late = node_name("decode", sound.url), node_name("decode", slow.url)
        assert joined[quick] < JOIN_WAIT_SECONDS + 2 * ROUND_WAIT_SECONDS + 0.5, joined
        assert joined[late] > 2 * JOIN_WAIT_SECONDS + ROUND_WAIT_SECONDS, joined  # once it answered
        merged = discovery.merged().target("glm")
        assert merged is not None and {n.name: n.dp_size for n in merged.nodes} == {quick: 1, late: 2}
        assert discovery.failures == {}
    finally:
        for server in (slow, sound, gateway):
            server.close()


def test_a_gateway_that_hangs_delays_no_other_and_a_hanging_metrics_page_no_join(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``other``'s worker list and ``glm``'s metrics page never answer. ``glm``'s nodes join at its
    first reading, and every call returns long before a hang's bound (the targets' 4 s timeout):
    none waits for a hung read (the margin is for a loaded machine, where a call's own work takes
    longer than its 0.5 s wait); each hang is counted and said once when that bound runs out."""
    hung_list, hung_page = Held(httpx.Response(200, json={"workers": []})), Held(httpx.Response(200))
    sound = Loopback(FakeEngine())
    glm = listing(worker(sound.url, "prefill"))
    try:
        settings = settings_of(
            gateway_target(
                "glm", glm.url, timeout_seconds=HUNG, sglang_router_metrics=f"{hung_page.url}/metrics"
            ),
            gateway_target("other", hung_list.url, timeout_seconds=HUNG),
        )

        async def run() -> tuple[GatewayDiscovery, list[tuple[float, dict[str, NodeChange]]]]:
            http = HttpClient(64)
            discovery = GatewayDiscovery(settings, http, Limits())
            try:
                return discovery, await rounds_of(discovery, HUNG + 1.5)
            finally:
                await http.aclose()

        discovery, seen = asyncio.run(run())
        at, first = next((at, changes) for at, changes in seen if "glm" in changes)
        assert first["glm"].joined == [node_name("prefill", sound.url)]
        assert at < HUNG - 1, f"glm's nodes joined {at:.2f}s in"
        calls = [later - earlier for (earlier, _), (later, _) in itertools.pairwise([(0.0, {}), *seen])]
        assert max(calls) < HUNG - 1, calls
        assert {key for key in discovery.failures} == {("glm", "", "metrics"), ("other", "", "workers")}
        assert len(warnings(caplog, "glm", "metrics read failed")) == 1
        assert len(warnings(caplog, "other", "workers read failed")) == 1
        assert "glm" not in discovery.circuits  # an unread page says no breaker is closed
    finally:
        for server in (hung_list, hung_page, sound, glm):
            server.close()


# --- end to end: the real gateway lists a hostile worker beside sound ones -------------------------


async def _tiny_engine(request: web.Request) -> web.Response:
    """A prefill worker whose server info says its KV pool holds 16 tokens (an attacker's, or a
    broken engine); it answers the gateway's health and model questions as the reference worker."""
    if request.path in ("/server_info", "/get_server_info"):
        return web.json_response(
            {
                "context_length": 8192,
                "max_total_num_tokens": 16,
                "page_size": 16,
                "disaggregation_mode": "prefill",
                "version": "0.5.11",
            }
        )
    if request.path in ("/model_info", "/get_model_info"):
        return web.json_response({"model_path": MODEL, "is_generation": True})
    if request.path == "/v1/models":
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})
    return web.json_response({"status": "ok"})


@dataclass
class Fleet:
    prefills: dict[str, PrefillServer]  # roomy (listed), spare (registered by a test)
    decode: WorkerProcess
    tiny: RecordingHost
    far: str
    glm: Any  # tests.workers.test_pd_gateway.Gateway: both sound servers, tiny and the far host
    other: Any  # the sound servers only
    logs: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from tests.workers.test_pd_gateway import need_router, start_gateway

    need_router()
    logs = tmp_path_factory.mktemp("gateway-hostile")
    roomy = ("--prefill-pool-tokens", "16384")
    prefills, decodes = start_servers(
        logs, {"roomy": ("reject", *roomy), "spare": ("reject", *roomy)}, {"d0": ()}
    )
    tiny = RecordingHost(host="127.0.0.1", handler=_tiny_engine)
    # The far host's name resolves nowhere: the gateway reaches it through this proxy, which sends
    # every request to the decode server (the gateway lists only workers it reached).
    proxy = RecordingHost(host="127.0.0.1", upstream=decodes["d0"].url)
    gateways: list[Any] = []
    try:
        with pytest.MonkeyPatch.context() as env:
            for name in ("http_proxy", "HTTP_PROXY"):
                env.setenv(name, proxy.url)
            for name in ("no_proxy", "NO_PROXY"):
                env.setenv(name, "127.0.0.1,localhost")
            gateways.append(start_gateway(logs, [prefills["roomy"]], [decodes["d0"]]))
        gateways.append(start_gateway(logs, [prefills["roomy"]], [decodes["d0"]]))
        glm, other = gateways
        far = f"http://{FAR_HOST}:30000"
        for registered in (
            {"url": tiny.url, "worker_type": "prefill", "bootstrap_port": free_port()},
            {"url": far, "worker_type": "decode"},
        ):
            added = httpx.post(f"{glm.url}/workers", json=registered, timeout=10)
            assert added.status_code == 202, added.text
            wait_listed(glm.url, registered["url"], present=True)
        yield Fleet(prefills, decodes["d0"], tiny, far, glm, other, logs)
    finally:
        stop_processes([g.proc for g in gateways])
        stop_servers(prefills, decodes)
        tiny.close()
        proxy.close()


def by_base(guards: list[GuardFacts]) -> dict[str, tuple[str, int]]:
    """Each api_base key's guard: (its target, its pool)."""
    return {base: (guard.target, guard.kv_pool_tokens) for guard in guards for base in guard.api_bases}


def test_one_hostile_worker_stops_no_join_and_poisons_no_guard(
    fleet: Fleet, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval = 0.5
    # A sound node's join-time reads that outlast JOIN_WAIT_SECONDS join it a reading later, as
    # designed (the unit tests above hold that); here every read is waited out to its own bound, so
    # what the first reading holds is down to the hostile entries, not to how busy the machine is.
    monkeypatch.setattr("kvcanary.monitor.runs.discovery.JOIN_WAIT_SECONDS", READ_SECONDS)
    settings = settings_of(
        gateway_target("glm", fleet.glm.url, discovery_interval_seconds=interval),
        gateway_target("other", fleet.other.url, discovery_interval_seconds=interval),
    )

    async def run() -> tuple[
        GatewayDiscovery, list[tuple[float, dict[str, NodeChange]]], TargetFacts, list[GuardFacts]
    ]:
        http = HttpClient(64)
        discovery = GatewayDiscovery(settings, http, Limits())
        try:
            both_changed = lambda seen: {"glm", "other"} <= set(first_changes(seen))  # noqa: E731
            seen = await rounds_of(discovery, 120.0, pause=0.2, done=both_changed)
            seen += await rounds_of(discovery, 4 * interval, pause=0.2)  # the far host said once over these
            merged = discovery.merged()
            keys = {"alice": KEYS["alice"], "bob": KEYS["bob"]}
            clients = {t.name: OpenAIHttpTarget(t, keys, client=http) for t in merged.targets}
            facts = TargetFacts(clients)
            guards = AdmissionFacts(lambda: merged, clients, facts)
            await guards.refresh()
            return discovery, seen, facts, guards.current()
        finally:
            await http.aclose()

    discovery, seen, facts, guards = asyncio.run(run())
    roomy, d0 = node_name("prefill", fleet.prefills["roomy"].url), node_name("decode", fleet.decode.url)
    tiny = node_name("prefill", fleet.tiny.url)
    joined = joined_by(seen)
    assert set(joined["glm"]) == {roomy, d0, tiny} and set(joined["other"]) == {roomy, d0}, joined
    # At the first reading: each gateway's first change is every node it lists but the far host,
    # counted in readings, not seconds (a loaded machine's pace moved a bound of 1 s).
    first = {target: set(change.joined) for target, change in first_changes(seen).items()}
    assert first == {"glm": {roomy, d0, tiny}, "other": {roomy, d0}}, (first, joined)

    # The far host: refused, said once over every reading, counted.
    assert discovery.refused == {"glm": {"url": 1}, "other": {}}
    said = warnings(caplog, "does not take as nodes")
    assert len(said) == 1 and f"({len(fleet.far)} characters)" in said[0], said
    series = exported(discovery, facts)
    assert series["kvcanary_gateway_workers_refused"] == {("glm", "url"): 1.0}

    # The node that says 16 tokens guards nothing; every other deployment keeps its own guard.
    assert facts.untrusted == {("glm", tiny): "below_floor"}
    assert series["kvcanary_node_pool_untrusted"] == {("glm", tiny, "below_floor"): 1.0}
    guarded = by_base(guards)
    pool = 16384  # the sound prefill server's own, as started
    assert api_base_key(fleet.tiny.url) not in guarded
    assert guarded[api_base_key(fleet.prefills["roomy"].url)] == ("glm", pool)
    for deployment in (fleet.glm.url, fleet.decode.url):  # the gateway's, and a decode node's
        assert guarded[api_base_key(deployment)] == ("glm", pool)
    assert guarded[api_base_key(fleet.other.url)] == ("other", pool)
    assert {p for _, p in guarded.values()} == {pool}


def test_a_node_joins_within_a_few_intervals_while_its_gateways_metrics_page_hangs(
    fleet: Fleet, served: Callable[..., Served]
) -> None:
    """``kvcanary serve`` watches both gateways, ``glm``'s metrics page answering only after 40 s;
    a prefill server registered with ``glm`` is audited within a few discovery intervals of its
    listing, the page's read counted and said once."""
    interval = 1.0
    page = Held(httpx.Response(200, text="# no breakers\n"), after=40)
    spare = fleet.prefills["spare"]
    worker_id = None
    try:
        audited = {"probes": list(AUDITS), "probe_intervals": dict.fromkeys(AUDITS, 3600)}
        monitor = served(
            {
                "targets": [
                    gateway_target("glm", fleet.glm.url, discovery_interval_seconds=interval,
                                   sglang_router_metrics=f"{page.url}/metrics", **audited),
                    gateway_target("other", fleet.other.url, discovery_interval_seconds=interval, **audited),
                ],
                "scheduler": {"jitter_seconds": 0.1},
            }
        ).start()  # fmt: skip
        roomy = node_name("prefill", fleet.prefills["roomy"].url)
        monitor.wait_for("the listed prefill node's audit", lambda: results_of(monitor, roomy), timeout=60)
        added = httpx.post(
            f"{fleet.glm.url}/workers",
            json={"url": spare.url, "worker_type": "prefill", "bootstrap_port": spare.bootstrap_port},
            timeout=10,
        )
        assert added.status_code == 202, added.text
        worker_id = added.json()["worker_id"]
        listed_at = wait_listed(fleet.glm.url, spare.url, present=True)
        joined = node_name("prefill", spare.url)
        rows = monitor.wait_for("the added node's audit", lambda: results_of(monitor, joined), timeout=60)
        took = min(datetime.fromisoformat(row["started_at"]).timestamp() for row in rows) - listed_at
        assert took < 3 * interval + 2, (
            f"audited {took:.1f}s after the gateway listed it\n{monitor.log()[-3000:]}"
        )
        # Each read of the page runs out at its bound (5 s), is counted, and said once in all.
        said = "glm: gateway: metrics read failed"
        monitor.wait_for(
            "the page's read to run out", lambda: said in monitor.log(), timeout=READ_SECONDS + 5
        )
        time.sleep(READ_SECONDS + 1)  # another read of it has run out
        assert page.asked >= 2
        log = monitor.log()
        assert log.count("does not take as nodes") == 1, log[-3000:]
        assert log.count("metrics read failed") == 1, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        if worker_id is not None:
            httpx.delete(f"{fleet.glm.url}/workers/{worker_id}", timeout=10)
        page.close()
