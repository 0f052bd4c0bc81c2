"""The tap protocol's second implementation, in TypeScript for Node gateways (``taps/node``), held
to every golden vector and judged by a real monitor exactly as the Python tap is.

- Its own tests (``node --test``: every vector of ``tests/fixtures/wire/``, and its sender against
  a scripted ingest on loopback) run here, so that a failure shows in the suite.
- A Node gateway hosting it (``taps/node/examples/gateway.ts``, a pass-through proxy as a Node
  gateway would be) relays customers' requests, JSON and streamed, to a scripted engine that
  leaks one caller's note into another's answer; ``kvcanary serve`` flags that answer by the same
  check, and nothing of the benign traffic, as it does the same exchanges sent by the Python tap to
  a target of their own.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.tap import Tap
from kvcanary.tap.bodies import exchange_of_bodies
from tests.monitor.served import Served, reference_target
from tests.support import REPO, free_port
from tests.support.loopback import Loopback

TAP = REPO / "taps" / "node"
KEY = "a-fingerprint-key-both-taps-share-0001"
#: Callers by their gateway key: the gateway's teams.
TEAMS = {"sk-victim": "team-victim", "sk-reader": "team-reader", "sk-a": "team-a", "sk-b": "team-b"}
WORDS = [
    "invoice", "shipment", "warranty", "battery", "charger", "cable", "adapter", "router", "firmware",
    "refund", "order", "parcel", "tracking", "address", "delivery", "replacement", "screen", "keyboard",
    "laptop", "printer", "toner", "cartridge", "subscription", "renewal",
]  # fmt: skip
SYSTEM = "You are the support assistant of a hardware shop. Answer briefly, politely and in English."


@pytest.fixture(scope="module")
def node_tap() -> Path:
    """Build ``taps/node`` (``npm ci`` when its lock changed, then ``tsc``); return its ``dist``."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        if os.environ.get("KVCANARY_REQUIRE_NODE"):
            pytest.fail("node and npm are required (KVCANARY_REQUIRE_NODE=1) and not installed")
        pytest.skip("node and npm are not installed (scripts/test.sh installs and requires them)")
    done = subprocess.run(
        ["bash", "scripts/setup-node-tap.sh"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return TAP / "dist"


def test_the_node_tap_makes_every_golden_vector_and_sends_as_the_protocol_says(node_tap: Path) -> None:
    done = subprocess.run(
        ["node", "--test", "--test-reporter=tap", str(node_tap / "test")],
        cwd=TAP, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    counts = dict(line[2:].split(" ", 1) for line in done.stdout.splitlines() if line.startswith("# "))
    assert counts.get("fail") == "0" and int(counts.get("pass", "0")) >= 16, counts


def note(rng: random.Random, words: int) -> str:
    """A customer's own text: words in an order no one else's text has."""
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


class Engine:
    """A scripted engine on loopback: answers each chat completion with the text the test set for
    its last user message, as JSON or as server-sent events; every exchange is kept."""

    def __init__(self) -> None:
        self.answers: dict[str, str] = {}
        self.exchanges: list[tuple[dict[str, Any], dict[str, Any] | list[dict[str, Any]]]] = []
        self.server = Loopback(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked = body["messages"][-1]["content"]
        said = self.answers[asked]
        usage = {"prompt_tokens": len(json.dumps(body)) // 4, "completion_tokens": len(said) // 4}
        if body.get("stream"):
            cut = len(said) // 2
            deltas = [({"content": said[:cut]}, None), ({"content": said[cut:]}, None), ({}, "stop")]
            chunks = [
                {"id": "chatcmpl-s", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                for delta, finish in deltas
            ]
            chunks[-1]["usage"] = usage
            self.exchanges.append((body, chunks))
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        choice = {"index": 0, "message": {"role": "assistant", "content": said}, "finish_reason": "stop"}
        answer = {"id": f"chatcmpl-{len(self.exchanges)}", "object": "chat.completion", "usage": usage,
                  "choices": [choice]}  # fmt: skip
        self.exchanges.append((body, answer))
        return httpx.Response(200, json=answer)


@pytest.fixture
def engine() -> Iterator[Engine]:
    made = Engine()
    yield made
    made.server.close()


def traffic(rng: random.Random) -> list[tuple[str, str, str, bool]]:
    """The customers' exchanges, in order: (key, question, answer, streamed). One leak: the
    reader's answer holds the victim's note, which no one else sent."""
    secret = note(rng, 120)
    exchanges = [("sk-victim", f"Please file this note: {secret}", "Filed, thank you.", False)]
    for i in range(12):
        key = ("sk-a", "sk-b", "sk-reader")[i % 3]
        own = note(rng, 60)
        # Benign: an answer quoting the caller's own words, and short answers of common words.
        answer = f"You wrote: {own}" if i % 2 else "We will look into it and answer by mail."
        exchanges.append((key, f"{key} asks: {own}", answer, i % 4 == 1))
    exchanges.append(("sk-reader", "Where is my parcel?", f"Your parcel: {secret}", True))  # the leak
    exchanges.append(("sk-a", "Thanks, bye.", "Goodbye.", False))
    return exchanges


def flagged(monitor: Served, target: str) -> list[tuple[str, list[str]]]:
    """Return the (caller, checks) of every record of ``target`` a check flagged."""
    items = monitor.get("/api/v1/traffic", target=target, limit=100).json()["items"]
    return sorted((r["caller"], sorted(r["checks"])) for r in items if r["checks"])


def test_a_leak_through_the_node_tap_is_flagged_as_through_the_python_tap_and_benign_traffic_is_not(
    node_tap: Path, served: Callable[[dict[str, Any]], Served], engine: Engine
) -> None:
    node_base, python_base = f"http://127.0.0.1:{free_port()}/v1", f"http://127.0.0.1:{free_port()}/v1"
    engine_base = engine.server.url + "/v1"
    # The Node gateway names the engine it relays to; the Python tap, a deployment of its own.
    targets = [
        reference_target("node-side", node_base, probes=["canary"], interval_seconds=3600,
                         gateway_api_bases=[engine_base]),
        reference_target("python-side", python_base, probes=["canary"], interval_seconds=3600),
    ]  # fmt: skip
    monitor = served({"targets": targets, "traffic": {"pass_interval_seconds": 1}})
    monitor.env["KVCANARY_INGEST_TOKEN"] = "ingest-" + monitor.token[:20]
    monitor.start()
    # A tap before version 4 (no version in its batch) is refused, named and counted.
    token = monitor.env["KVCANARY_INGEST_TOKEN"]
    record = {"id": "r", "time": 1, "api_base": "x", "status": 200}
    old = monitor.post("/api/v1/traffic", token=token, json={"gateway": "old", "records": [record]})
    assert old.status_code == 400 and old.json()["versions"] == [4], old.text
    assert (
        monitor.value("kvcanary_traffic_version_refused_records_total", transport="http", version="none") == 1
    )

    env = {
        **os.environ, "KVCANARY_TAP_URL": monitor.url, "KVCANARY_TAP_TOKEN": token,
        "KVCANARY_TAP_KEY": KEY, "KVCANARY_TAP_GATEWAY": "node-gw", "KVCANARY_TAP_FLUSH_SECONDS": "0.05",
        "GATEWAY_UPSTREAM": engine_base, "GATEWAY_TEAMS": ",".join(f"{k}={t}" for k, t in TEAMS.items()),
    }  # fmt: skip
    gateway = subprocess.Popen(
        ["node", str(node_tap / "examples" / "gateway.js")], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert gateway.stdout is not None
        port = json.loads(gateway.stdout.readline())["listening"]
        sent = traffic(random.Random(7))
        for key, question, answer, stream in sent:
            engine.answers[question] = answer
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            body = {"model": "support-model", "stream": stream, "messages": messages}
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
            assert reply.status_code == 200 and answer.split()[0] in reply.text
            time.sleep(0.1)  # one exchange judged before the next: as customers' requests come
    finally:
        gateway.send_signal(signal.SIGTERM)
        out, _ = gateway.communicate(timeout=30)
    stats = json.loads(out.strip().splitlines()[-1])["stats"]
    assert stats == {"sent": len(sent), "dropped": 0, "rejected": 0, "pending": 0}, out

    # The same exchanges, as the engine answered them, through the Python tap to a target of their own.
    python_tap = Tap(monitor.url, token, KEY.encode(), gateway="python-gw", flush_seconds=0.05)
    for (key, *_), (request, answer) in zip(sent, engine.exchanges, strict=True):
        streamed = isinstance(answer, list)
        exchange = exchange_of_bodies(
            request, None if streamed else answer, events=answer if streamed else None, started=time.time(),
            caller=TEAMS[key], caller_kind="team", key=key, api_base=python_base, model_group="support-model",
        )  # fmt: skip
        python_tap.observe(exchange)
        time.sleep(0.1)
    python_tap.close()
    assert python_tap.stats()["sent"] == len(sent)

    node = monitor.wait_for("the node tap's leak", lambda: flagged(monitor, "node-side"), timeout=30)
    python = monitor.wait_for("the python tap's leak", lambda: flagged(monitor, "python-side"), timeout=30)
    assert node == python, (node, python)  # the same check flags the same exchange, whichever tap
    assert node == [("team-reader", ["overlap"])]  # the leak, and nothing of the benign traffic
    judged = monitor.value("kvcanary_traffic_records_total", target="node-side", check="overlap")
    assert judged == monitor.value("kvcanary_traffic_records_total", target="python-side", check="overlap")
