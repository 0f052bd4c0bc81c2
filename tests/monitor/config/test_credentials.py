"""``monitor/config/credentials.py``: which URLs a target's credentials may go to, and which
credential each request carries. The rules are matched on URLs as aiohttp connects to them."""

from __future__ import annotations

import re

import pytest
from yarl import URL

from kvcanary.monitor.config.credentials import Credentials, CredentialScope, parse_host_rule
from kvcanary.monitor.config.targets import NodeConfig, TargetConfig

BASE = "http://gw.example:30000"


def scope(*allowed: str, named: tuple[str, ...] = ()) -> CredentialScope:
    return CredentialScope(BASE, named, allowed)


@pytest.mark.parametrize(
    ("url", "place"),
    [
        ("http://gw.example:30000/v1/completions", "base"),
        ("http://GW.Example.:30000/tokenize", "base"),  # case and a trailing dot are the same host
        ("http://gw.example:30001/", None),  # another port is another origin
        ("https://gw.example:30000/", None),  # and another scheme
        ("http://gw.example/", None),
        ("http://gw.example.evil.test:30000/", None),
        ("http://user:pw@gw.example:30000/", None),  # userinfo: never a credential on top
    ],
)
def test_the_base_urls_origin_is_scheme_host_and_port(url: str, place: str | None) -> None:
    assert scope().place(URL(url)) == place


def test_a_default_port_is_the_scheme_default() -> None:
    assert CredentialScope("http://gw.example").place(URL("http://gw.example:80/x")) == "base"
    assert CredentialScope("https://gw.example").place(URL("https://gw.example:443/x")) == "base"
    assert CredentialScope("https://gw.example").place(URL("http://gw.example:443/x")) is None


@pytest.mark.parametrize(
    ("entry", "inside", "outside"),
    [
        (
            "gpu-7.internal",
            ["http://gpu-7.internal:1/", "https://GPU-7.internal./"],
            ["http://gpu-8.internal/"],
        ),
        ("gpu-7.internal:30000", ["http://gpu-7.internal:30000/"], ["http://gpu-7.internal:30001/"]),
        ("10.0.0.7", ["http://10.0.0.7:8000/"], ["http://10.0.0.8:8000/", "http://10.0.0.70/"]),
        ("10.0.0.7:80", ["http://10.0.0.7/"], ["https://10.0.0.7/"]),
        (
            "10.0.0.0/8",
            ["http://10.200.3.4:30000/", "http://[::ffff:10.0.0.5]:1/"],  # a mapped address is its IPv4
            ["http://11.0.0.1/", "http://10.0.0.1.nip.io/", "http://[fd00::1]/"],
        ),
        ("fd00::/8", ["http://[fd12::1]:8000/"], ["http://[fe80::1]/", "http://10.0.0.1/"]),
        (
            "[fd00::7]:8000",
            ["http://[fd00::7]:8000/", "http://[FD00:0::7]:8000/"],
            ["http://[fd00::7]:8001/"],
        ),
        ("fd00::7", ["http://[fd00::7]:1/"], ["http://[fd00::8]:1/"]),
        (
            ".svc.cluster.local",
            ["http://prefill-0.sglang.svc.cluster.local:30000/", "http://a.SVC.cluster.local./"],
            [
                "http://svc.cluster.local/",
                "http://evilsvc.cluster.local/",
                "http://a.svc.cluster.local.evil.test/",
            ],
        ),
        ("xn--80akhbyknj4f.example", ["http://испытание.example/"], ["http://example/"]),
    ],
)
def test_each_entry_covers_its_hosts_and_nothing_more(
    entry: str, inside: list[str], outside: list[str]
) -> None:
    rules = scope(entry)
    assert [url for url in inside if rules.place(URL(url)) != "scope"] == []
    assert [url for url in outside if rules.place(URL(url)) is not None] == []


@pytest.mark.parametrize(
    "url",
    [
        "http://allowed.example@evil.example/",  # userinfo before the real host
        "http://allowed.example:80@evil.example/",
        "http://evil.example#@allowed.example/",  # the host ends at '#'
        "http://evil.example%2f@allowed.example/",  # a host written under userinfo is still userinfo
        "http://evil.example/allowed.example",
        "http://allowed.example.evil.example/",
        "http://127.1/",  # a resolver's 127.0.0.1, a name here: no address entry covers it
        "http://2130706433/",
        "http://0x7f.0.0.1/",
        "http://010.0.0.1/",
    ],
)
def test_tricks_with_the_url_reach_no_allowed_host(url: str) -> None:
    rules = scope("allowed.example", "127.0.0.0/8", "10.0.0.0/8")
    assert rules.place(URL(url)) is None
    assert rules.place(URL("http://allowed.example/")) == "scope"


def test_a_node_the_file_names_is_in_scope_and_one_the_gateway_lists_is_not() -> None:
    target = TargetConfig.model_validate(
        {
            "name": "glm",
            "base_url": BASE,
            "tenants": [{"name": "a"}],
            "probes": ["canary"],
            "sglang_router": BASE,
            "nodes": [
                {"name": "p0", "role": "prefill", "info_url": "http://10.0.0.7:30000"},
                {
                    "name": "d0",
                    "role": "decode",
                    "info_url": "http://10.0.0.8:30000",
                    "metrics_url": "http://10.0.0.8:9100/metrics",
                },
            ],
        }
    )
    found = NodeConfig(name="d1", role="decode", info_url="http://10.0.0.9:30000")
    found = found.model_copy(update={"discovered": True})
    target = target.model_copy(update={"nodes": [*target.nodes, found]})
    rules = target.credential_scope()
    assert rules.allows("http://10.0.0.7:30000/tokenize") and rules.allows("http://10.0.0.8:9100/metrics")
    assert not rules.allows("http://10.0.0.7:30001/")  # the node's origin, not its host
    assert not rules.allows("http://10.0.0.9:30000/v1/completions")
    widened = target.model_copy(update={"credential_hosts": ["10.0.0.0/24"]}).credential_scope()
    assert widened.allows("http://10.0.0.9:30000/v1/completions")
    assert not widened.allows("not a url") and not widened.allows("ftp://10.0.0.9/")


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("", "empty"),
        ("http://10.0.0.7:30000", "not a URL"),
        ("user@10.0.0.7", "not a URL"),
        ("*.svc.cluster.local", "'.svc.cluster.local'"),
        ("10.0.0.1/8", "not a CIDR"),
        ("0.0.0.0/0", "every address"),
        ("::/0", "every address"),
        ("gpu:0", "port"),
        ("gpu:65536", "port"),
        ("gpu:http", "port"),
        ("[fd00::1", "expected [address]"),
        ("[fd00::1]x", "expected [address]"),
        ("[gpu]:80", "not an IPv6 address"),
        ("fd00::zz", "not an IPv6 address"),
        ("gpu!.internal", "not a host name"),
        ("a..b", "not a host name"),
        (".", "not a host name"),
        ("-gpu.internal", "not a host name"),
        ("127.1", "four decimal numbers"),
        ("2130706433", "four decimal numbers"),
        ("испытание.example", "ASCII"),
    ],
)
def test_a_bad_entry_is_refused_saying_why(entry: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_host_rule(entry)


KEYS = {"alice": "sk-alice-0001", "bob": None, "carol": "sk-carol-0003"}


def test_each_request_carries_the_credential_its_place_allows() -> None:
    rules = scope("10.0.0.0/8")
    tenants = Credentials(rules, KEYS)
    at_base, in_scope, outside = (
        URL(BASE + "/v1/chat/completions"),
        URL("http://10.0.0.7:1/"),
        URL("http://x.y/"),
    )
    assert tenants.authorization(at_base, "alice") == {"Authorization": "Bearer sk-alice-0001"}
    assert tenants.authorization(at_base, "bob") == {}  # an engine that takes no key from bob
    assert tenants.authorization(at_base, None) == {"Authorization": "Bearer sk-alice-0001"}  # a lookup
    assert tenants.authorization(in_scope, "carol") == {"Authorization": "Bearer sk-carol-0003"}
    assert tenants.authorization(outside, "alice") == {} == tenants.authorization(outside, None)

    workers = Credentials(rules, KEYS, worker_key="sk-worker-0009")
    assert workers.authorization(at_base, "carol") == {"Authorization": "Bearer sk-carol-0003"}
    assert workers.authorization(in_scope, "carol") == {"Authorization": "Bearer sk-worker-0009"}
    assert workers.authorization(in_scope, None) == {"Authorization": "Bearer sk-worker-0009"}
    assert workers.authorization(outside, "carol") == {}
    assert sorted(workers.secrets) == ["sk-alice-0001", "sk-carol-0003", "sk-worker-0009"]
