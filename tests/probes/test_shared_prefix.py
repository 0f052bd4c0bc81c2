"""shared_prefix: tenants whose prompts share a long start and then differ must get their own answers.

Against the reference worker with a shared prefix cache, with and without its
``prefix-key-partial`` bug (page keys covering the prompt's first pages only), and at the network
seam for what a run sends and how a model that cannot repeat is judged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvcanary.monitor.runs.execute import execute_probe
from kvcanary.probes.base import Verdict
from kvcanary.probes.markers import MarkerBook
from tests.probes.probe_harness import (
    KEYS,
    MODEL,
    TENANTS,
    Call,
    FakeEngine,
    Reference,
    answer,
    run_kind,
)

CACHED = ("--mode", "aggregated", "--kv-pool-tokens", "4096", "--page-size", "16", "--prefix-cache", "shared")
BUGGY = (*CACHED, "--bug", "prefix-key-partial")


def judged(worker: Reference, **options: Any) -> tuple[Verdict, str, dict[str, Any]]:
    return run_kind("shared_prefix", worker, **options)


def test_a_worker_keying_whole_pages_passes_every_step(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = judged(reference(*CACHED))
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    steps = [t["step"] for t in evidence["tenants"]]
    assert steps == ["concurrent"] * 2 + ["sequential"] * 2 + ["salted"] * 2 + ["system"] * 2
    assert evidence["judged"] == "own_and_foreign_markers"
    # The prefix spans the pages a partial key would miss: 256 tokens asked (16 pages of 16), as
    # many as whole letters make (a letter and its space are two byte tokens).
    prefix = evidence["prefix"]
    assert (prefix["prefix_tokens_asked"], prefix["page_size"]) == (256, 16)
    assert 250 <= prefix["prefix_tokens"] <= 256


def test_a_prefix_key_covering_the_first_pages_only_leaks_the_other_tenants_marker(reference) -> None:  # type: ignore[no-untyped-def]
    verdict, reason, evidence = judged(reference(*BUGGY))
    assert (verdict, reason) == (Verdict.LEAK, "foreign_marker"), evidence
    assert {leak["owner_tenant"] for leak in evidence["leaks"]} <= set(TENANTS)
    assert evidence["leak_count"] >= 1


def test_the_per_tenant_cache_with_the_same_bug_keeps_tenants_apart_but_not_requests(reference) -> None:  # type: ignore[no-untyped-def]
    # Per-tenant salting stops the leak across tenants; the bug still serves a tenant its own
    # earlier request's text, marker and all: a mismatch, not a leak.
    worker = reference("--mode", "aggregated", "--kv-pool-tokens", "4096", "--prefix-cache", "per-tenant",
                       "--bug", "prefix-key-partial")  # fmt: skip
    verdict, reason, evidence = judged(worker)
    assert (verdict, reason) == (Verdict.MISMATCH, "other_request_marker"), evidence


def test_the_bug_needs_a_prefix_cache(start_worker) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Exception, match="--bug prefix-key-partial needs a prefix cache"):
        start_worker("--bug", "prefix-key-partial")


def salt_ignored(call: Call) -> httpx.Response:
    """The reference worker's echo, reporting every prompt as served from cache (salts ignored)."""
    text = call.prompt[: call.body["max_tokens"]]
    tokens = len(call.prompt.encode())
    usage = {"prompt_tokens": tokens, "completion_tokens": len(text.encode()),
             "prompt_tokens_details": {"cached_tokens": tokens - 1}}  # fmt: skip
    return httpx.Response(200, json={"choices": [{"message": {"content": text}, "finish_reason": "stop"}],
                                     "usage": usage})  # fmt: skip


def run_at_seam(fake: FakeEngine, **options: Any) -> tuple[Verdict, str, dict[str, Any]]:
    async def go() -> tuple[Verdict, str, dict[str, Any]]:
        async with fake.target(engine="vllm") as target:
            config = target._config.model_copy(
                update={"probes": ["shared_prefix"], "options": {"shared_prefix": options}}
            )
            result, _ = await execute_probe("shared_prefix", target, MarkerBook(), config)
        return result.verdict, result.reason, result.evidence

    return asyncio.run(go())


def test_a_fresh_salt_served_from_cache_is_a_mismatch() -> None:
    verdict, reason, evidence = run_at_seam(FakeEngine(reply=salt_ignored), stream=False)
    assert (verdict, reason) == (Verdict.MISMATCH, "cache_domain_ignored"), evidence
    salted = [t for t in evidence["tenants"] if t.get("step") == "salted"]
    assert salted and all(t["reason"] == "cache_domain_ignored" for t in salted)
    # Without salts the same answers pass: cached tokens are no fault where no domain was fresh.
    verdict, reason, _ = run_at_seam(FakeEngine(reply=salt_ignored), stream=False, salted=False)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact")


def test_each_listed_adapter_is_asked_for_by_name_with_the_prefix() -> None:
    fake = FakeEngine()
    run_at_seam(fake, adapters=["sql-lora", "chat-lora"], salted=False)
    calls = [c for c in fake.calls if c.path.endswith("completions")]
    models = [c.body["model"] for c in calls]
    assert models.count("sql-lora") == 1 and models.count("chat-lora") == 1
    prompts = [c.body["messages"][-1]["content"] for c in calls if c.body["model"] == "sql-lora"]
    first = next(c for c in calls if c.body["model"] == MODEL and len(c.prompt) > 200)
    assert prompts[0].split("\n")[0] == first.prompt.split("\n")[0]  # the same shared prefix


def does_not_repeat(call: Call) -> httpx.Response:
    """A model that answers every prompt with the same words: it repeats no nonce."""
    return answer(call, "the the the")


def test_a_model_that_does_not_repeat_is_judged_on_foreign_markers_only() -> None:
    verdict, reason, evidence = run_at_seam(FakeEngine(reply=does_not_repeat), salted=False)
    assert (verdict, reason) == (Verdict.PASS, "no_foreign_marker"), evidence
    assert evidence["judged"] == "foreign_markers_only"


def test_stated_repeats_skips_the_lone_canary_and_judges_own_markers() -> None:
    fake = FakeEngine(reply=does_not_repeat)
    verdict, reason, _ = run_at_seam(fake, salted=False, repeats=True)
    assert (verdict, reason) == (Verdict.MISMATCH, "nonce_missing")
    asked = [c for c in fake.calls if c.path.endswith("completions")]
    assert len(asked) == 6  # 2 concurrent, 2 sequential, 2 system: no lone canary


def test_a_session_cache_restores_only_under_the_same_salt(reference) -> None:  # type: ignore[no-untyped-def]
    # The kind caught the session cache's first version, which restored unsalted K/V for a fresh
    # salt (272 cached tokens reported): a cache domain ignored, as LMCache#4825's connector did.
    worker = reference("--mode", "aggregated", "--kv-pool-tokens", "8192", "--session-cache", "8")
    verdict, reason, evidence = judged(worker)
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence


ADAPTERS = ("--lora-adapter", "sql-lora", "--lora-adapter", "chat-lora")


def test_adapters_keep_their_own_cache_domain(reference) -> None:  # type: ignore[no-untyped-def]
    worker = reference(*CACHED, *ADAPTERS)
    listed = httpx.get(f"{worker.url}/v1/models", headers={"Authorization": f"Bearer {KEYS['alice']}"}).json()
    assert [(m["id"], m.get("parent")) for m in listed["data"]] == [
        (MODEL, None),
        ("sql-lora", MODEL),
        ("chat-lora", MODEL),
    ]
    verdict, reason, evidence = judged(worker, adapters=["sql-lora", "chat-lora"])
    assert (verdict, reason) == (Verdict.PASS, "nonce_intact"), evidence
    assert [t["step"] for t in evidence["tenants"]].count("adapter sql-lora") == 1


def test_a_prefix_key_leaving_out_the_adapter_is_caught_by_the_adapters_first_request(reference) -> None:  # type: ignore[no-untyped-def]
    # The K/V is the same bytes (the copy model has no adapter weights), so no text changes: the
    # cache's own count says the adapter's first request was served the base model's pages.
    worker = reference(*CACHED, *ADAPTERS, "--bug", "prefix-key-no-adapter")
    verdict, reason, evidence = judged(worker, adapters=["sql-lora", "chat-lora"])
    assert (verdict, reason) == (Verdict.MISMATCH, "cache_domain_ignored"), evidence
    flagged = {t["step"] for t in evidence["tenants"] if t["reason"] == "cache_domain_ignored"}
    assert flagged == {"adapter sql-lora", "adapter chat-lora"}, evidence
