"""The incident's topology for real: SGLang's own model gateway (``sglang-router`` 0.3.2, its own venv)
in ``--pd-disaggregation`` mode in front of two prefill and two decode reference servers.

The venv is ``$KVCANARY_SGLANG_ROUTER_VENV`` (or ``kvcanary/venv-sglang-router`` in
``$XDG_CACHE_HOME``, ``~/.cache`` by default), made by ``bash scripts/setup-sglang-router.sh``.
Without it the tests here are skipped, unless ``KVCANARY_REQUIRE_SGLANG_ROUTER=1``, which turns
the skip into a failure.

Eight servers start once for the module: two prefill servers that reject over-capacity prompts
(the fix), two with the placeholder defect, two plain decode servers and two that verify page
ownership. Three gateways pick from them: ``fixed`` (reject x plain), ``defective`` (placeholder x
plain) and ``verified`` (placeholder x verified). Each prefill server's pool is the incident's
small one: 1,024 tokens under an 8,192-token window.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.processes import free_port, stop_processes, wait_http
from tests.support import WorkerProcess
from tests.workers.pd_support import PrefillServer, metric, start_servers, stop_servers
from tests.workers.support import CANARY, MODEL, OVER_CAPACITY_PROMPT, PROMPT_A

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
VENV = Path(os.environ.get("KVCANARY_SGLANG_ROUTER_VENV") or CACHE / "kvcanary" / "venv-sglang-router")
ROUTER_PYTHON = VENV / "bin" / "python"
VERIFY = ("--verify-ownership",)


@pytest.fixture(scope="module", autouse=True)
def _need_router() -> None:
    need_router()


def need_router() -> None:
    """Skip without the gateway's venv; fail under ``KVCANARY_REQUIRE_SGLANG_ROUTER=1``."""
    if not (ROUTER_PYTHON.exists() and (VENV / ".kvcanary-setup").exists()):
        message = f"no sglang-router venv at {VENV}: run bash scripts/setup-sglang-router.sh"
        if os.environ.get("KVCANARY_REQUIRE_SGLANG_ROUTER") == "1":
            pytest.fail(message)
        pytest.skip(message)


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    #: Its own Prometheus page (--prometheus-port, on loopback).
    metrics_url: str = ""

    def complete(self, prompt: str, key: str = "sk-a", **fields: Any) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, **fields},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )


def start_gateway(
    log_dir: Path,
    prefills: list[PrefillServer],
    decodes: list[WorkerProcess],
    policy: str = "round_robin",
    more: tuple[str, ...] = (),
) -> Gateway:
    """Start the real gateway in PD mode with ``policy`` (and ``more`` of its flags) and wait until
    it holds every worker healthy."""
    port, metrics_port = free_port(), free_port()
    argv = [str(ROUTER_PYTHON), "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for prefill in prefills:
        argv += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    for decode in decodes:
        argv += ["--decode", decode.url]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *more]
    log = log_dir / f"gateway-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    gateway = Gateway(f"http://127.0.0.1:{port}", proc, log, f"http://127.0.0.1:{metrics_port}/metrics")
    try:
        wait_http(f"{gateway.url}/health", timeout=60, proc=proc)
        _wait_workers_healthy(gateway, len(prefills) + len(decodes))
    except Exception as exc:
        stop_processes([proc])
        raise RuntimeError(
            f"the gateway did not start: {exc}\n{log.read_text(errors='replace')[-4000:]}"
        ) from exc
    return gateway


def _wait_workers_healthy(gateway: Gateway, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = httpx.get(f"{gateway.url}/workers", timeout=5).json()["workers"]
        if len(workers) == count and all(w["is_healthy"] for w in workers):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the gateway did not hold {count} healthy workers in {timeout:.0f} s")


@dataclass
class Topology:
    prefills: dict[str, PrefillServer]
    decodes: dict[str, WorkerProcess]
    gateways: dict[str, Gateway]


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    logs = tmp_path_factory.mktemp("pd-gateway")
    prefills, decodes = start_servers(
        logs,
        {f"{admission}{i}": (admission,) for admission in ("reject", "placeholder") for i in range(2)},
        {f"{name}{i}": flags for name, flags in (("plain", ()), ("verified", VERIFY)) for i in range(2)},
    )
    gateways: dict[str, Gateway] = {}
    try:
        pick = {
            "fixed": ("reject", "plain"),
            "defective": ("placeholder", "plain"),
            "verified": ("placeholder", "verified"),
        }
        for name, (prefill, decode) in pick.items():
            gateways[name] = start_gateway(
                logs,
                [prefills[f"{prefill}{i}"] for i in range(2)],
                [decodes[f"{decode}{i}"] for i in range(2)],
            )
        yield Topology(prefills, decodes, gateways)
    finally:
        stop_processes([g.proc for g in gateways.values()])
        stop_servers(prefills, decodes)


def test_the_gateway_registers_both_prefill_and_both_decode_servers(topology: Topology) -> None:
    listed = httpx.get(f"{topology.gateways['fixed'].url}/workers").json()
    by_url = {w["url"]: w for w in listed["workers"]}
    for name in ("reject0", "reject1"):
        prefill = topology.prefills[name]
        assert by_url[prefill.url]["worker_type"] == "prefill"
        assert by_url[prefill.url]["bootstrap_port"] == prefill.bootstrap_port
        assert by_url[prefill.url]["metadata"]["disaggregation_mode"] == "prefill"
    for name in ("plain0", "plain1"):
        assert by_url[topology.decodes[name].url]["worker_type"] == "decode"
    assert listed["stats"]["prefill_count"] == 2 and listed["stats"]["decode_count"] == 2


def test_a_completion_through_the_gateway_is_the_copied_prompt(topology: Topology) -> None:
    gateway = topology.gateways["fixed"]
    for _ in range(4):  # round robin: every prefill and every decode server serves one
        answer = gateway.complete(PROMPT_A, max_tokens=64)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == PROMPT_A[:64]
        assert answer.json()["usage"]["prompt_tokens"] == len(PROMPT_A)
    for name in ("plain0", "plain1"):
        assert metric(topology.decodes[name].url, "kvcanary_requests_total", code="200") >= 1


def test_a_chat_completion_and_a_stream_pass_through_the_gateway(topology: Topology) -> None:
    gateway = topology.gateways["fixed"]
    chat = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
        headers={"Authorization": "Bearer sk-a"},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 5  # max_tokens arrived as max_completion_tokens
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": "streamed through PD", "max_tokens": 50, "stream": True},
        headers={"Authorization": "Bearer sk-a"},
        timeout=60,
    ) as stream:
        assert stream.status_code == 200
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1])
    assert text == "streamed through PD"


def test_an_over_pool_prompt_on_a_rejecting_prefill_server_is_the_clients_400(topology: Topology) -> None:
    answer = topology.gateways["fixed"].complete(OVER_CAPACITY_PROMPT, key="sk-b", max_tokens=200)
    assert answer.status_code == 400
    assert "exceeds the maximum allowed length (1023 tokens)" in answer.text
    rejected = sum(
        metric(topology.prefills[n].url, "kvcanary_admission_rejections_total", reason="kv_capacity")
        for n in ("reject0", "reject1")
    )
    assert rejected == 1  # a 400 is not retried


def test_the_placeholder_defect_answers_200_with_another_tenants_text(topology: Topology) -> None:
    gateway = topology.gateways["defective"]
    for _ in range(4):  # tenant A's text now fills the front of both decode servers' free lists
        assert gateway.complete(PROMPT_A).status_code == 200
    answer = gateway.complete(OVER_CAPACITY_PROMPT, key="sk-b", max_tokens=200)
    assert answer.status_code == 200, answer.text
    assert CANARY in answer.json()["choices"][0]["text"]
    assert answer.json()["usage"]["prompt_tokens"] == 1
    substituted = sum(
        metric(topology.prefills[n].url, "kvcanary_placeholder_substitutions_total")
        for n in ("placeholder0", "placeholder1")
    )
    assert substituted >= 1


def test_a_verifying_decode_server_fails_the_defect_closed(topology: Topology) -> None:
    gateway = topology.gateways["verified"]
    for _ in range(4):  # verification lets healthy traffic through unchanged
        healthy = gateway.complete(PROMPT_A)
        assert healthy.status_code == 200 and healthy.json()["choices"][0]["text"] == PROMPT_A[:16]
    answer = gateway.complete(OVER_CAPACITY_PROMPT, key="sk-b", max_tokens=200)
    assert 500 <= answer.status_code < 600
    assert CANARY not in answer.text
    refused = sum(
        metric(topology.decodes[n].url, "kvcanary_kv_ownership_violations_total")
        for n in ("verified0", "verified1")
    )
    assert refused >= 1


def test_latency_through_the_gateway_is_not_held_back_by_nagle(topology: Topology) -> None:
    """A worker without TCP_NODELAY was measured answering in 44 ms behind this gateway instead of
    ~4 ms: Nagle's algorithm against a delayed ACK stalls every small answer on a kept-alive
    connection by ~40 ms. Here the prefill and the decode server's answers and the hand-off all
    cross sockets, so a stall would hold even the fastest of 40 requests over 40 ms; the median is
    printed, as load moves it (the fastest was 32 ms once, on a 2-core host running a full suite
    beside other work)."""
    url = f"{topology.gateways['fixed'].url}/v1/completions"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    took, transfers = [], []
    with httpx.Client(headers={"Authorization": "Bearer sk-a"}, timeout=60) as client:
        client.post(url, json=body)  # the gateway's connections to both servers are open from here
        for _ in range(40):
            started = time.perf_counter()
            answer = client.post(url, json=body)
            took.append(time.perf_counter() - started)
            transfers.append(float(answer.headers["x-kvcanary-kv-transfer-seconds"]))
    median, fastest = statistics.median(took) * 1000, min(took) * 1000
    hand_off = statistics.median(transfers) * 1000
    print(
        f"through the gateway: median {median:.1f} ms, fastest {fastest:.1f} ms, hand-off {hand_off:.1f} ms"
    )
    assert min(took) < 0.04
