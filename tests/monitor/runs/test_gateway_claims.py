"""What a gateway's listing cannot take: a URL the file gives another target, and another worker's
name. A gateway lists on loopback what an attacker's (or a misconfigured) gateway would: another
target's node, workers whose plain names meet. The node stays where the file put it, for the
records it routes and the quarantine its leaks earn; each worker stays a node of its own."""

from __future__ import annotations

import asyncio

import pytest

from kvcanary.monitor.config.base import NAME_RE
from kvcanary.monitor.routing import routes_of
from kvcanary.monitor.runs.discovery import GatewayDiscovery
from kvcanary.monitor.targets.http import HttpClient
from kvcanary.monitor.targets.openai_format import Limits
from kvcanary.monitor.targets.sglang_gateway import node_name, parse_workers
from kvcanary.wire import api_base_key
from tests.monitor.runs.test_gateway_hostile import (
    INTERVAL,
    exported,
    gateway_target,
    listing,
    rounds_of,
    settings_of,
    warnings,
    worker,
)
from tests.monitor.served import reference_target
from tests.probes.probe_harness import FakeEngine
from tests.support.loopback import Loopback


@pytest.mark.parametrize(
    "urls",
    [
        ("http://[fd00::1:2]:30000", "http://[fd00:1::2]:30000"),  # both fd00_1_2 once made plain
        ("http://xü.example:30000", "http://xö.example:30000"),  # both x_.example
        ("http://10.0.0.7:30000/engine-a", "http://10.0.0.7:30000/engine-b"),  # one host and port
        ("http://10.0.0.7:443", "https://10.0.0.7:443"),
    ],
)
def test_two_workers_whose_plain_names_meet_stay_two_nodes(urls: tuple[str, str]) -> None:
    answer = {"workers": [worker(url, "prefill") for url in urls]}
    first, again = parse_workers(answer), parse_workers(answer)
    assert [node.info_url for node in first.nodes] == list(urls)
    assert len({node.name for node in first.nodes}) == 2, [node.name for node in first.nodes]
    assert [n.name for n in first.nodes] == [n.name for n in again.nodes]  # stable at every reading
    assert all(NAME_RE.match(node.name) for node in first.nodes)
    assert first.refused == {}


def test_a_plain_workers_name_is_its_role_host_and_port() -> None:
    assert node_name("decode", "http://10.0.0.7:30000") == "decode-10.0.0.7-30000"
    assert node_name("prefill", "http://10.0.0.7:30000/") == "prefill-10.0.0.7-30000"


def test_a_gateway_listing_another_targets_node_does_not_take_it(caplog: pytest.LogCaptureFixture) -> None:
    """Target ``a``'s gateway lists its own worker and the node the file gives target ``b``; ``a``
    takes its own, ``b`` keeps its node (routes, quarantine), and the refusal is counted and said."""
    own, bs_node = Loopback(FakeEngine()), Loopback(FakeEngine())
    gateway = listing(worker(own.url), worker(bs_node.url, "prefill"))
    b_file_node = {"name": "b-prefill", "role": "prefill", "info_url": bs_node.url}
    settings = settings_of(
        gateway_target("a", gateway.url),
        reference_target("b", "http://127.0.0.1:9", nodes=[b_file_node], probes=["capacity"]),
    )
    try:

        async def run() -> GatewayDiscovery:
            http = HttpClient(16)
            discovery = GatewayDiscovery(settings, http, Limits())
            try:
                await rounds_of(discovery, 6 * INTERVAL)
                return discovery
            finally:
                await http.aclose()

        discovery = asyncio.run(run())
        merged = discovery.merged()
        a = merged.target("a")
        assert a is not None and [node.info_url for node in a.node_list()] == [own.url]
        routes = routes_of(merged)
        assert routes[api_base_key(bs_node.url)] == ("b", "b-prefill")
        assert routes[api_base_key(own.url)] == ("a", node_name("decode", own.url))
        assert exported(discovery)["kvcanary_gateway_workers_refused"] == {("a", "claimed"): 1.0}
        said = warnings(caplog, "does not take as nodes")
        assert len(said) == 1 and "1 claimed" in said[0] and bs_node.url in said[0], said
    finally:
        for server in (own, bs_node, gateway):
            server.close()
