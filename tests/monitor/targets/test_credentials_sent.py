"""What the target's client sends where: every request it makes (completions down both legs of a
path, ``/tokenize``, server info, metrics, ``fetch``) carries the credential the target's scope
allows and none elsewhere, and a redirect is never followed.

The nodes here are what a gateway lists (marked ``discovered``, as ``monitor/runs/discovery.py``
takes them) on 127.0.0.2, an address no URL of the target writes, served by recording hosts
that answer like an engine; the target's base URL is on 127.0.0.1. Real sockets, the monitor's
real client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from kvcanary.monitor.config.targets import NodeConfig, TargetConfig
from kvcanary.monitor.targets.openai_http import OpenAIHttpTarget
from kvcanary.probes.target import CompletionRequest
from tests.monitor.targets.recording_host import RecordingHost

KEYS: dict[str, str | None] = {"alice": "sk-alice-cred-0001", "bob": "sk-bob-cred-0002"}
WORKER_KEY = "sk-worker-cred-0009"
PROMPT = "Repeat exactly: KVC-0a1b2c3d"


async def engine(request: web.Request) -> web.Response:
    """Answer like the reference worker: a completion echoing its prompt, a count, its server info."""
    if request.path.endswith("/completions"):
        body = json.loads(await request.read())
        choice = {"index": 0, "text": body.get("prompt", ""), "finish_reason": "stop"}
        usage = {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}
        return web.json_response({"object": "text_completion", "choices": [choice], "usage": usage})
    if request.path == "/tokenize":
        return web.json_response({"count": 8, "tokens": list(range(8))})
    if request.path in ("/server_info", "/get_server_info"):
        return web.json_response({"context_length": 8192, "max_total_num_tokens": 4096, "version": "0"})
    if request.path == "/metrics":
        return web.Response(text="# TYPE kvcanary_worker_up gauge\nkvcanary_worker_up 1\n")
    return web.json_response({"object": "list", "data": [{"id": "kvcanary-reference"}]})


@pytest.fixture
def hosts() -> Iterator[dict[str, RecordingHost]]:
    """The target's own base (127.0.0.1) and a prefill and a decode node on 127.0.0.2."""
    made = {
        "base": RecordingHost(host="127.0.0.1", handler=engine),
        "prefill": RecordingHost(handler=engine),
        "decode": RecordingHost(handler=engine),
    }
    yield made
    for host in made.values():
        host.close()


def gateway_target(hosts: dict[str, RecordingHost], **fields: Any) -> TargetConfig:
    """The target with both nodes as its gateway lists them (its base URL names the gateway)."""
    config = TargetConfig.model_validate(
        {
            "name": "glm",
            "base_url": hosts["base"].url,
            "sglang_router": hosts["base"].url,
            "tenants": [{"name": "alice"}, {"name": "bob"}],
            "probes": ["canary"],
            "timeout_seconds": 10,
            **fields,
        }
    )
    found = [
        NodeConfig(name="prefill-rogue", role="prefill", info_url=hosts["prefill"].url, bootstrap_port=8998),
        NodeConfig(name="decode-rogue", role="decode", info_url=hosts["decode"].url),
    ]
    return config.model_copy(update={"nodes": [n.model_copy(update={"discovered": True}) for n in found]})


def every_request(config: TargetConfig, worker_key: str | None = None) -> None:
    """Make each kind of request the client makes, as alice and bob, through the base and down the path."""

    async def go() -> None:
        async with OpenAIHttpTarget(config, KEYS, worker_key=worker_key) as target:
            [path] = config.paths()
            down = target.via(path)
            for tenant in ("alice", "bob"):
                assert (await down.complete(tenant, CompletionRequest(PROMPT, chat=False))).status == 200
                assert (await target.complete(tenant, CompletionRequest(PROMPT, chat=False))).status == 200
            assert await down.count_tokens(PROMPT) == 8
            assert (await down.capacity()).kv_pool_tokens == 4096
            assert (await target.scrape(path.decode.metrics_url)).samples is not None
            assert (await target.fetch(path.prefill.metrics_url)).text is not None

    asyncio.run(go())


def keys_seen(host: RecordingHost) -> dict[str, set[str | None]]:
    """Each path the host was asked for, and the Authorization headers it came with."""
    seen: dict[str, set[str | None]] = {}
    for request in host.requests():
        seen.setdefault(request.path, set()).add(request.authorization)
    return seen


def test_nodes_the_gateway_lists_outside_the_scope_get_no_key_on_any_request(
    hosts: dict[str, RecordingHost],
) -> None:
    every_request(gateway_target(hosts))
    prefill, decode = keys_seen(hosts["prefill"]), keys_seen(hosts["decode"])
    assert {"/v1/completions", "/tokenize", "/server_info", "/metrics"} <= prefill.keys()
    assert {"/v1/completions", "/server_info", "/metrics"} <= decode.keys()
    assert set().union(*prefill.values(), *decode.values()) == {None}
    # The base URL is where the tenants are served: each got there with its own key.
    assert keys_seen(hosts["base"])["/v1/completions"] == {f"Bearer {KEYS['alice']}", f"Bearer {KEYS['bob']}"}


def test_hosts_the_operator_allows_get_the_tenants_keys_or_the_worker_credential(
    hosts: dict[str, RecordingHost],
) -> None:
    allowed = gateway_target(hosts, credential_hosts=["127.0.0.2"])
    every_request(allowed)
    tenants = {f"Bearer {KEYS['alice']}", f"Bearer {KEYS['bob']}"}
    assert keys_seen(hosts["prefill"])["/v1/completions"] == tenants
    assert keys_seen(hosts["decode"])["/v1/completions"] == tenants
    assert keys_seen(hosts["prefill"])["/tokenize"] == {f"Bearer {KEYS['alice']}"}  # a lookup: one key

    for host in hosts.values():
        host.seen.clear()
    every_request(allowed, worker_key=WORKER_KEY)
    for role in ("prefill", "decode"):
        assert set().union(*keys_seen(hosts[role]).values()) == {f"Bearer {WORKER_KEY}"}, role
    assert keys_seen(hosts["base"])["/v1/completions"] == tenants  # never the worker credential


def test_a_redirect_to_another_host_is_not_followed(hosts: dict[str, RecordingHost]) -> None:
    rogue = hosts["decode"]

    async def elsewhere(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(rogue.url + request.path_qs)

    sender = RecordingHost(host="127.0.0.1", handler=elsewhere)
    try:
        config = TargetConfig(name="t", base_url=sender.url, tenants=[{"name": "alice"}], probes=["canary"])

        async def go() -> tuple[Any, ...]:
            async with OpenAIHttpTarget(config, KEYS) as target:
                completion = await target.complete("alice", CompletionRequest(PROMPT))
                fetched = await target.fetch(sender.url + "/metrics")
                return completion, fetched, await target.count_tokens(PROMPT)

        completion, fetched, count = asyncio.run(go())
    finally:
        sender.close()
    assert (completion.status, fetched.status, count) == (307, 307, None)
    assert sender.requests()[0].authorization == f"Bearer {KEYS['alice']}"
    assert rogue.requests() == []


def test_a_worker_credential_an_engine_echoes_is_scrubbed(hosts: dict[str, RecordingHost]) -> None:
    async def echo_key(request: web.Request) -> web.Response:
        said = request.headers.get("Authorization", "")
        return web.json_response({"error": {"message": f"key {said} is not valid here"}}, status=403)

    decode = RecordingHost(handler=echo_key)
    try:
        hosts_now = {**hosts, "decode": decode}
        config = gateway_target(hosts_now, credential_hosts=["127.0.0.0/8"])

        async def go() -> Any:
            async with OpenAIHttpTarget(config, KEYS, worker_key=WORKER_KEY) as target:
                return await target.via(config.paths()[0]).complete("alice", CompletionRequest(PROMPT))

        completion = asyncio.run(go())
    finally:
        decode.close()
    assert completion.status == 403 and decode.requests()[0].authorization == f"Bearer {WORKER_KEY}"
    assert WORKER_KEY not in completion.text + (completion.error or "")
    assert "<api-key>" in completion.text
