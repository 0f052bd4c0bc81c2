"""The gateway's admission guard (``kvcanary/tap/containment/guard.py``): a prompt a deployment's KV pool
surely cannot hold is kept off it, the group's other deployments take it, and a group with none
that can refuses at once, naming the pools; never on a guess.

The deployments' tokenizer is a real reference worker's ``/tokenize`` (one token per byte of the
prompt, and a chat template around messages), its pool as the monitor would publish it. The guard
reads the set a real :class:`QuarantineWatch` holds, parsed from the contract's JSON. With LiteLLM
in front: ``tests/litellm/test_admission_litellm.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.tap.containment.document import parse_quarantine
from kvcanary.tap.containment.guard import (
    AdmissionGuard,
    AdmissionRefused,
    least_tokens,
    prompt_of,
    tokenize_over_http,
)
from kvcanary.tap.containment.watch import QuarantineWatch
from kvcanary.wire import api_base_key
from tests.support import WorkerProcess, launch_worker, stop_process, wait_worker
from tests.support.loopback import Loopback
from tests.support.signing import document

GROUP = "shop"
WORKER = ["--mode", "aggregated", "--kv-pool-tokens", "8192", "--context-window", "8192"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    started = launch_worker(WORKER, tmp_path_factory.mktemp("admission"))
    try:
        yield wait_worker(started)
    finally:
        stop_process(started.proc)


def deployment(api_base: str, model: str = "openai/tiny") -> dict[str, Any]:
    return {"model_name": GROUP, "litellm_params": {"api_base": api_base, "model": model}}


def guard_of(*guards: dict[str, Any], calls: list[str] | None = None) -> AdmissionGuard:
    """A guard reading ``guards`` as a monitor's answer publishes them; ``calls`` notes every
    tokenize URL asked."""
    watch = QuarantineWatch("http://127.0.0.1:9", "token", keys={}, start=False)
    body = {**document(), "guards": list(guards)}
    watch.current = parse_quarantine(json.dumps(body).encode())

    def tokenize(url: str, body: dict[str, Any], api_key: str | None) -> int | None:
        if calls is not None:
            calls.append(url)
        return tokenize_over_http(url, body, api_key)

    return AdmissionGuard(watch, count=lambda target, mode: None, tokenize=tokenize)


def guard(
    target: str, api_base: str, pool: int, mode: str = "enforce", cpt: float | None = None
) -> dict[str, Any]:
    return {"target": target, "api_bases": [api_base_key(api_base)], "mode": mode,
            "kv_pool_tokens": pool, "chars_per_token": cpt}  # fmt: skip


def chat(chars: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "x" * chars}]


def admit(g: AdmissionGuard, deployments: list[Any], messages: Any, request: Any = None) -> list[Any]:
    return asyncio.run(g.admit(GROUP, deployments, messages, request))


def test_without_guards_every_deployment_is_kept_and_nothing_is_counted(worker: WorkerProcess) -> None:
    calls: list[str] = []
    g = guard_of(calls=calls)
    group = [deployment(f"{worker.url}/v1")]
    assert admit(g, group, chat(100_000)) is group
    assert calls == [] and not g.counts


def test_a_prompt_that_surely_fits_costs_no_tokenizer_call(worker: WorkerProcess) -> None:
    calls: list[str] = []
    g = guard_of(guard("small", f"{worker.url}/v1", 4096), calls=calls)
    group = [deployment(f"{worker.url}/v1")]
    assert admit(g, group, chat(900)) == group  # 4 bytes a character and the template: under 4096
    assert calls == []


def test_a_prompt_over_the_pool_goes_to_the_deployment_that_holds_it(worker: WorkerProcess) -> None:
    small, roomy = f"{worker.url}/v1", f"http://localhost:{worker.port}/v1"  # one tokenizer, two names
    calls: list[str] = []
    g = guard_of(guard("small", small, 1024), guard("roomy", roomy, 16384), calls=calls)
    group = [deployment(small), deployment(roomy)]
    assert admit(g, group, chat(3000)) == [group[1]]
    assert g.counts == {("small", "enforce"): 1}
    assert len(calls) == 1, calls  # the roomy pool holds the bytes' bound: no count needed there
    # Under the small pool by its bytes and the template allowance: kept, without a count.
    assert admit(g, group, chat(900)) == group


def test_a_group_that_cannot_hold_the_prompt_is_refused_naming_the_pools(worker: WorkerProcess) -> None:
    g = guard_of(guard("small", f"{worker.url}/v1", 1024))
    with pytest.raises(AdmissionRefused) as refused:
        admit(g, [deployment(f"{worker.url}/v1")], chat(3000))
    assert refused.value.status_code == 400 and refused.value.num_retries == 0
    assert refused.value.tokens > 3000  # the worker's count: one token a byte, and the template
    assert "'small': 1024 tokens" in refused.value.message and GROUP in refused.value.message
    # What the tap's record of the refusal names: the deployment kept off, the count, its pool.
    api_base, why = refused.value.kvcanary_refusal
    assert api_base == api_base_key(f"{worker.url}/v1")
    assert (why.by, why.tokens, why.kv_pool_tokens) == ("admission", refused.value.tokens, 1024)


def test_a_completion_prompt_is_counted_as_sent(worker: WorkerProcess) -> None:
    g = guard_of(guard("small", f"{worker.url}/v1", 1024))
    with pytest.raises(AdmissionRefused) as refused:
        admit(g, [deployment(f"{worker.url}/v1")], None, {"prompt": "y" * 2000})
    assert refused.value.tokens == 2000


def test_without_a_count_only_the_calibrations_wide_bound_refuses(tmp_path: Path) -> None:
    """No tokenizer answers (port 9): a prompt is refused only when it is over the pool at eight
    times the densest text the monitor measured; short of that it is admitted."""
    nowhere = "http://127.0.0.1:9/v1"
    uncalibrated = guard_of(guard("t", nowhere, 1024))
    assert admit(uncalibrated, [deployment(nowhere)], chat(200_000)) == [deployment(nowhere)]
    calibrated = guard_of(guard("t", nowhere, 1024, cpt=4.0))
    assert admit(calibrated, [deployment(nowhere)], chat(30_000)) == [deployment(nowhere)]  # 937 at 32
    with pytest.raises(AdmissionRefused):
        admit(calibrated, [deployment(nowhere)], chat(40_000))  # 1,250 tokens at 32 a token: sure


def test_observe_mode_keeps_every_deployment_and_counts_what_it_would_refuse(
    worker: WorkerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    g = guard_of(guard("small", f"{worker.url}/v1", 1024, mode="observe"))
    group = [deployment(f"{worker.url}/v1")]
    for _ in range(3):
        assert admit(g, group, chat(3000)) == group
    assert g.counts == {("small", "observe"): 3}
    assert sum("observe mode" in r.getMessage() for r in caplog.records) == 1


def test_a_deployment_without_a_guard_is_never_counted_or_kept_off(worker: WorkerProcess) -> None:
    calls: list[str] = []
    g = guard_of(guard("small", f"{worker.url}/v1", 1024), calls=calls)
    other = deployment("https://api.example.com/v1")
    assert admit(g, [other], chat(3000)) == [other] and calls == []


def test_prompts_are_read_from_chat_parts_and_nothing_else() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "image_url"}]}]
    found = prompt_of(parts, None)
    assert found is not None and found.chars == 3
    assert prompt_of(None, {"input": "embedding text"}) is None  # not a prompt this guard counts
    assert prompt_of([], None) is None


@pytest.mark.parametrize(
    "guards",
    [
        {},
        [{"target": "t", "api_bases": ["x"], "mode": "on", "kv_pool_tokens": 1, "chars_per_token": None}],
        [
            {
                "target": "t",
                "api_bases": ["x"],
                "mode": "enforce",
                "kv_pool_tokens": 0,
                "chars_per_token": None,
            }
        ],
        [{"target": "t", "api_bases": ["x"], "mode": "enforce", "kv_pool_tokens": True}],
        [{"target": "t", "api_bases": ["x"], "mode": "enforce", "kv_pool_tokens": 9, "chars_per_token": -1}],
    ],
)
def test_guards_not_the_contracts_refuse_the_whole_answer(guards: Any) -> None:
    body = {**document(), "guards": guards}
    with pytest.raises(ValueError):
        parse_quarantine(json.dumps(body).encode())


def test_an_answer_without_guards_is_a_monitor_that_publishes_none() -> None:
    body = {k: v for k, v in document().items() if k != "guards"}
    assert parse_quarantine(json.dumps(body).encode()).guards == {}


# --- a count no tokenizer makes is no count ---------------------------------------------------------


@pytest.mark.parametrize("said", [{"count": 1}, {"count": 0}, {"tokens": [7]}])
def test_a_count_the_prompts_size_rules_out_is_no_count(
    said: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A deployment's tokenizer (an attacker's host, or an engine with the incident's bug) counts
    one token, or none, for a prompt of 40,000 characters: no tokenizer makes that count. Taken at
    its word, the guard would send the prompt to a pool of 1,024 tokens; it is no count instead,
    and the calibration's bound refuses it, as it would with no tokenizer at all."""
    liar = Loopback(lambda request: httpx.Response(200, json=said))
    try:
        base = f"{liar.url}/v1"
        calibrated = guard_of(guard("t", base, 1024, cpt=4.0))
        with pytest.raises(AdmissionRefused) as refused:
            admit(calibrated, [deployment(base)], chat(40_000))
        assert refused.value.tokens == 40_014 // 32  # the characters at 8 times the densest text
        with pytest.raises(AdmissionRefused):
            admit(calibrated, [deployment(base)], None, {"prompt": "z" * 40_000})
        said_so = [
            r.getMessage() for r in caplog.records if "no tokenizer makes that count" in r.getMessage()
        ]
        assert len(said_so) == 1 and liar.url in said_so[0]  # once per tokenizer, not per request
        # Without a calibration nothing sure is left: admitted, as with no count (never a guess).
        uncalibrated = guard_of(guard("t", base, 1024))
        assert admit(uncalibrated, [deployment(base)], chat(40_000)) == [deployment(base)]
    finally:
        liar.close()


def test_a_count_the_size_allows_is_taken_however_dense() -> None:
    """The bound rules out only what no tokenizer makes: a count of a prompt's bytes over 1,024 (a
    run of spaces, which some tokenizers pack that densely) is still a count, and fits."""
    loose = Loopback(lambda request: httpx.Response(200, json={"count": 40}))
    try:
        base = f"{loose.url}/v1"
        g = guard_of(guard("t", base, 1024))
        spaces = [{"role": "user", "content": " " * 40_000}]
        assert least_tokens(prompt_of(spaces, None), None) == 40  # type: ignore[arg-type]
        assert admit(g, [deployment(base)], spaces) == [deployment(base)]
    finally:
        loose.close()
