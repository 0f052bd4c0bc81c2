"""Shared helpers for the worker's tests: small pools, the leak scenario's prompts, request helpers.

Sizes follow the incident at toy scale: a 1024-token prefill pool under an 8192-token context
window, so a 1500-token prompt fits the context but not the pool.
"""

from __future__ import annotations

from typing import Any

from kvcanary.workers.config import WorkerConfig
from kvcanary.workers.engine import Engine
from kvcanary.workers.request import Event, TokenEvent

MODEL = "kvcanary-reference"
CANARY = "ALICE-CANARY-7f3a9c"
# Tenant A's prompt: 600 bytes, the canary every 20 bytes, so any stretch of 40 bytes shows it whole.
PROMPT_A = (CANARY + " ") * 30
OVER_CAPACITY_PROMPT = "B" * 1500  # > prefill pool (max_req_input_len 1023), < context window 8192

SMALL = {
    "device": "cpu",
    "page_size": 16,
    "kv_pool_tokens": 1024,
    "prefill_pool_tokens": 1024,
    "decode_pool_tokens": 4096,
    "context_window": 8192,
    "max_batch": 16,
}
SMALL_FLAGS = (
    "--page-size", "16", "--kv-pool-tokens", "1024", "--prefill-pool-tokens", "1024",
    "--decode-pool-tokens", "4096", "--context-window", "8192",
)  # fmt: skip
PLACEHOLDER_FLAGS = ("--mode", "disaggregated", "--admission", "placeholder", *SMALL_FLAGS)


def small_config(**overrides: Any) -> WorkerConfig:
    """Return the tests' small WorkerConfig with ``overrides`` applied."""
    return WorkerConfig(**{**SMALL, **overrides})


def complete(client: Any, prompt: str, *, key: str | None = None, **fields: Any) -> Any:
    """POST /v1/completions for ``prompt`` as the tenant of ``key``; return the response."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **fields}, headers=headers)


def four_grams(text: str) -> set[str]:
    """Return every 4-character substring of ``text``."""
    return {text[i : i + 4] for i in range(len(text) - 3)}


class Collector:
    """Collect one request's events (an engine's ``emit``)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    @property
    def text(self) -> str:
        return bytes(e.token_id for e in self.events if isinstance(e, TokenEvent)).decode(errors="replace")

    @property
    def last(self) -> Event:
        return self.events[-1]


def run_until_idle(engine: Engine) -> None:
    """Drive ``engine`` without its thread until nothing waits or runs."""
    while engine.batch or engine._waiting:
        engine.admit_waiting()
        if engine.batch:
            engine.decode_once()


def submit(engine: Engine, text: str, max_tokens: int, tenant: str, **options: Any) -> Collector:
    """Submit ``text`` as ``tenant`` (``options``: e.g. ``cache_salt``); return its collector."""
    collector = Collector()
    engine.submit(list(text.encode()), max_tokens, tenant=tenant, emit=collector, **options)
    return collector
