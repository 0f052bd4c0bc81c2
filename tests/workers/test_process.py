"""The worker as a real process on loopback: the official openai SDK as client, tenants in flight
together, the disclosed leak end to end with API keys, and a prefix cache shared across tenants."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import WorkerProcess
from tests.workers.support import CANARY, MODEL, OVER_CAPACITY_PROMPT, PROMPT_A


def sdk(worker: WorkerProcess, key: str = "tenant-x") -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_it_serves_the_openai_sdk_plain_and_streamed(worker_pair: dict[str, WorkerProcess]) -> None:
    client = sdk(worker_pair["healthy"])
    completion = client.completions.create(model=MODEL, prompt="Hello from the SDK", max_tokens=64)
    assert completion.choices[0].text == "Hello from the SDK"
    assert completion.usage is not None and completion.usage.prompt_tokens == 18
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.content == "sys\nhi"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "streamed"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "streamed"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert [m.id for m in client.models.list()] == [MODEL]


def test_it_raises_sdk_errors_for_bad_requests(worker_pair: dict[str, WorkerProcess]) -> None:
    client = sdk(worker_pair["healthy"])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)


def test_it_keeps_tenants_apart_while_they_decode_together(worker_pair: dict[str, WorkerProcess]) -> None:
    url = worker_pair["healthy"].url
    prompts = {f"tenant-{i}": f"<{i}> " + f"secret of tenant {i} " * (3 + i) for i in range(8)}
    answers: dict[str, str] = {}

    def ask(tenant: str) -> None:
        response = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": prompts[tenant], "max_tokens": 500},
            headers={"Authorization": f"Bearer {tenant}"},
            timeout=60,
        )
        answers[tenant] = response.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(tenant,)) for tenant in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == prompts


def test_it_reproduces_the_disclosed_leak_end_to_end(worker_pair: dict[str, WorkerProcess]) -> None:
    worker = worker_pair["defective"]
    a = sdk(worker, "sk-a").completions.create(model=MODEL, prompt=PROMPT_A)
    assert a.usage is not None and a.usage.prompt_tokens == len(PROMPT_A)
    b = sdk(worker, "sk-b").completions.create(model=MODEL, prompt=OVER_CAPACITY_PROMPT, max_tokens=200)
    assert CANARY in b.choices[0].text  # HTTP 200 carrying tenant A's text
    assert b.usage is not None and b.usage.prompt_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        sdk(worker, "sk-wrong").completions.create(model=MODEL, prompt="x")
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(worker.url + "/metrics").text)}
    assert families["kvcanary_placeholder_substitutions"].samples[0].value == 1
    assert "sk-a" not in worker.output() and "sk-b" not in worker.output()


def test_it_shares_a_tenant_prompt_with_another_tenant_in_shared_prefix_cache_mode(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    keys = ("--api-key", "sk-a=tenant-a", "--api-key", "sk-b=tenant-b")
    worker = start_worker("--prefix-cache", "shared", *keys)
    prompt = "Tenant A's long system prompt. " * 4  # 124 bytes: seven whole pages

    def cached_tokens(key: str, **extra: str) -> int:
        usage = sdk(worker, key).completions.create(model=MODEL, prompt=prompt, extra_body=extra).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    assert cached_tokens("sk-a") == 0
    assert cached_tokens("sk-b") == 112  # the finding: B learns that someone sent A's prompt
    assert cached_tokens("sk-b", cache_salt="b-only") == 0
    scrape = httpx.get(worker.url + "/metrics").text
    info = {f.name: f for f in text_string_to_metric_families(scrape)}["kvcanary_worker_info"].samples[0]
    assert (info.labels["prefix_cache"], info.value) == ("shared", 1)
    assert httpx.get(worker.url + "/get_server_info").json()["prefix_cache"] == "shared"
