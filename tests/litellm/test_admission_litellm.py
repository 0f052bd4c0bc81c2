"""The admission guard end to end: ``kvcanary serve`` publishes each guarded
deployment's smallest KV pool, and a real LiteLLM proxy with the tap keeps every prompt that pool
surely cannot hold off the deployment, before any upstream call.

Two reference workers are the two deployments of model group ``shop``: ``glm`` has the incident's
defect (a prefill pool of 1,024 tokens below a window of 8,192, and the placeholder admission that
answers an over-pool prompt from stale pages), ``calm`` holds 16,384. ``glm`` alone is also the
group ``solo``. Under ``admission_guard: enforce``, customers send long prompts (over ``glm``'s
pool, within the window) and short ones through the proxy:

- no over-pool prompt reaches ``glm`` (its own count of placeholder substitutions stays 0), and
  every long prompt is answered by ``calm``; no request is refused, short ones still reach both;
- in ``solo`` a long prompt is refused at once with a 400 naming the pool, a short one answered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from kvcanary.wire import api_base_key
from tests.monitor.served import Served, reference_target
from tests.support import WorkerProcess, launch_worker, stop_process, wait_worker
from tests.support.litellm import Proxy, launch_proxy, write_proxy_config
from tests.support.signing import SigningKeys, make_keys, served_set

POOL = ["--mode", "disaggregated", "--context-window", "8192", "--decode-pool-tokens", "16384"]
POOL += ["--page-size", "16"]
DEFECTIVE = [*POOL, "--prefill-pool-tokens", "1024", "--admission", "placeholder"]
SOUND = [*POOL, "--prefill-pool-tokens", "16384", "--admission", "reject"]
INGEST = "admission-test-ingest-token-0123456789"
CUSTOMER = "sk-acme-0001"
LONG_CHARS = 3000  # one token a byte on the reference worker: over 1,024, well within 8,192
ROUNDS = 20

pytestmark = pytest.mark.external_service


@dataclass
class Stack:
    monitor: Served
    proxy: Proxy
    leaky: WorkerProcess
    sound: WorkerProcess
    keys: SigningKeys


def write_gateway(folder: Path, leaky: WorkerProcess, sound: WorkerProcess) -> Path:
    """``shop`` is both workers, ``solo`` the defective one alone."""
    config = write_proxy_config(folder, {"shop": leaky.url})
    document = yaml.safe_load(config.read_text())
    first = document["model_list"][0]

    def deployment(group: str, worker: WorkerProcess) -> dict[str, object]:
        return {
            **first,
            "model_name": group,
            "litellm_params": {**first["litellm_params"], "api_base": f"{worker.url}/v1"},
        }

    document["model_list"] = [deployment("shop", leaky), deployment("shop", sound), deployment("solo", leaky)]
    config.write_text(yaml.safe_dump(document))
    return config


@pytest.fixture
def stack(served: Callable[..., Served], tmp_path: Path) -> Iterator[Stack]:
    leaky, sound = launch_worker(DEFECTIVE, tmp_path), launch_worker(SOUND, tmp_path)
    keys = make_keys(tmp_path / "keys")  # the guard's facts reach the gateway signed
    proxy = None
    try:
        wait_worker(leaky), wait_worker(sound)
        probes = {"probes": ["canary"], "probe_intervals": {"canary": 60.0}}
        monitor = served({
            "targets": [
                reference_target("glm", leaky.url, **probes),
                reference_target("calm", sound.url, **probes),
            ],
            "containment": {"mode": "observe", "admission_guard": "enforce"},
            "containment_signing": keys.monitor_config(),
            "traffic": {"ingest_token_env": "KVC_TEST_INGEST"},
        })  # fmt: skip
        monitor.env["KVC_TEST_INGEST"] = INGEST
        monitor.start()
        env = {
            "KVCANARY_TAP_URL": monitor.url,
            "KVCANARY_TAP_TOKEN": INGEST,
            "KVCANARY_TAP_GATEWAY": "gw-guard",
            "KVCANARY_TAP_KEY": "a-fingerprint-key-the-monitor-never-sees",
            "KVCANARY_TAP_QUARANTINE": "1",
            **keys.tap_env(),
            "KVCANARY_TAP_QUARANTINE_POLL_SECONDS": "0.5",
        }
        proxy = launch_proxy(write_gateway(tmp_path / "gateway", leaky, sound), env)
        yield Stack(monitor, proxy, leaky, sound, keys)
    finally:
        for proc in [*([proxy.proc] if proxy else []), leaky.proc, sound.proc]:
            stop_process(proc)


def ask(client: httpx.Client, proxy: Proxy, group: str, chars: int) -> tuple[int, str, str]:
    """Return the status, the deployment that answered (its api_base key) and the body."""
    response = client.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {CUSTOMER}"},
        json={"model": group, "messages": [{"role": "user", "content": "q" * chars}], "max_tokens": 2},
    )
    return (
        response.status_code,
        api_base_key(response.headers.get("x-litellm-model-api-base", "")),
        response.text,
    )


def substitutions(worker: WorkerProcess) -> float:
    """The worker's own count of over-pool prompts it answered from a placeholder."""
    text = httpx.get(f"{worker.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvcanary_placeholder_substitutions_total"))  # fmt: skip


def guards_published(stack: Stack) -> bool:
    return len(served_set(stack.monitor.url, INGEST, stack.keys)["guards"]) == 2


def test_no_over_pool_prompt_reaches_the_small_pool_and_no_benign_request_is_refused(stack: Stack) -> None:
    stack.monitor.wait_for("the guards published", lambda: guards_published(stack), 30)
    leaky, sound = api_base_key(f"{stack.leaky.url}/v1"), api_base_key(f"{stack.sound.url}/v1")
    with httpx.Client(timeout=60) as client:
        # The gateway reads the set every 0.5 s: a long prompt routed by it shows it has it.
        first = stack.monitor.wait_for(
            "the gateway to hold the guards",
            lambda: (a := ask(client, stack.proxy, "solo", LONG_CHARS))[0] == 400 and a,
            30,
        )
        long_answers = [ask(client, stack.proxy, "shop", LONG_CHARS) for _ in range(ROUNDS)]
        short_answers = [ask(client, stack.proxy, "shop", 200) for _ in range(ROUNDS)]
        solo_short = ask(client, stack.proxy, "solo", 200)
    assert "'glm': 1024 tokens" in first[2] and "refused before any upstream call" in first[2], first[2]
    assert [status for status, _, _ in long_answers] == [200] * ROUNDS, long_answers
    assert {by for _, by, _ in long_answers} == {sound}  # every long prompt went to the pool that holds it
    assert [status for status, _, _ in short_answers] == [200] * ROUNDS
    assert {by for _, by, _ in short_answers} == {leaky, sound}  # short ones still reach both
    assert solo_short[0] == 200 and solo_short[1] == leaky
    assert substitutions(stack.leaky) == 0  # not one over-pool prompt reached the defective pool
    # Each refusal is a traffic record of glm's with the verdict `refused`, and no incident.
    kept = stack.monitor.wait_for(
        "the refusals kept",
        lambda: stack.monitor.get("/api/v1/traffic", target="glm", verdict="refused").json()["items"],
        30,
    )
    assert {(r["status_code"], r["caller"], r["findings"]["refused"]["by"]) for r in kept} == {
        (400, "acme", "admission")
    }
    assert all(r["findings"]["refused"]["kv_pool_tokens"] == 1024 for r in kept)
    assert all(r["findings"]["refused"]["tokens"] > 1024 for r in kept)
    assert (stack.monitor.value("kvcanary_traffic_refused_total", target="glm", by="admission") or 0) >= 1
    assert stack.monitor.get("/api/v1/incidents", target="glm").json()["items"] == []
