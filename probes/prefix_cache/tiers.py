"""Which cache tier served a request: the engine's per-tier counter, read around each request.

Engines keep cached K/V in tiers (the accelerator's pages, host memory, a disk or a connector) and a
salt must hold in every one: connectors and offload tiers have dropped a salt the engine above them
honoured (LMCache#4825, LMCache#3008, llm-d#1389). An answer's ``cached_tokens`` sums every tier, so
the salt check reads the engine's own per-tier counter (``probes.engine_counters.CACHE_TIERS``: vLLM's
``prompt_tokens_cached_by_source``, SGLang's ``cached_tokens_total{cache_source}``, the reference
worker's ``kvcanary_cached_tokens_by_tier_total``) on every node that prefills, before and after each
of its requests, one at a time: the counter's increase is the request's tokens by tier.

Why the reading is sound: a request's tiers are believed only when they add up to the
``cached_tokens`` the answer itself reported (``attributed``); the pages are read again for up to
:data:`SETTLE_SECONDS` for a counter that moves after the answer. Another client's hits between the
two reads make the sum too large: the tiers are then not attributed, and judge nothing (the answer's
own count still does), unless the node has one tier, every hit of which is that tier's. Which
tiers a node has comes from what it states (the reference worker's
``cache_tiers``, SGLang's HiCache settings) and from its counters: a tier whose counter ever moved.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from kvcanary.probes.base import ProbeContext
from kvcanary.probes.engine_counters import CACHE_TIERS, UNATTRIBUTED, tier_tokens
from kvcanary.probes.target import Node, ServerCapacity

#: How long the counters may take to show a request's hits after its answer came.
SETTLE_SECONDS = 2.0
#: Nodes read at most (a target's prefill nodes, each with its own caches).
MAX_NODES = 8


@dataclass(frozen=True)
class TierView:
    """How this target's cache tiers are read: from which nodes, which tiers it has (nearest
    first), and for each tier how many fresh requests of the audit's size push a prefix out of it
    (absent: not known, so a tier below it cannot be reached on purpose)."""

    engine: str
    nodes: tuple[Node, ...]
    present: tuple[str, ...]
    churn: dict[str, int] = field(default_factory=dict)

    def evidence(self) -> dict[str, Any]:
        return {
            "present": list(self.present),
            "churn_requests": self.churn,
            "nodes": [n.name for n in self.nodes],
        }


@dataclass(frozen=True)
class Served:
    """What one request's tiers were: each tier's tokens, and whether they add up to what its answer
    reported (None where the counters could not be read)."""

    tiers: dict[str, int] | None
    attributed: bool
    #: Attributed without the counters' word: a node with one tier, where every hit is that tier's.
    inferred: bool = False

    def tokens(self, tier: str) -> int:
        """Return the tokens ``tier`` served (0 when not attributed: such a reading judges nothing)."""
        return (self.tiers or {}).get(tier, 0) if self.attributed else 0

    def evidence(self) -> dict[str, Any]:
        return {"tiers": self.tiers, "tiers_attributed": self.attributed, "tiers_inferred": self.inferred}

    def or_only_tier(self, view: TierView, cached: int) -> Served:
        """Return this reading, or, where it could not be attributed (another client's hits moved the
        counters between its two reads) and the node has one tier, that tier's: nothing else can
        have served the request."""
        if self.attributed or len(view.present) != 1:
            return self
        return Served({view.present[0]: cached} if cached else {}, True, inferred=True)


async def tier_view(
    ctx: ProbeContext, capacity: ServerCapacity | None, request_tokens: int
) -> TierView | None:
    """Return how this target's tiers are read, or None where its engine counts none per tier or
    its counters cannot be read."""
    engine = ctx.target.engine
    tiers = CACHE_TIERS.get(engine)
    nodes = tuple(n for n in ctx.target.nodes if n.role != "decode")[:MAX_NODES]
    if tiers is None or not nodes:
        return None
    first = await read_tiers(ctx, nodes)
    if first is None:
        return None
    facts = capacity.facts if capacity is not None else {}
    stated = set(_stated(engine, facts)) | {t for t, n in first.items() if n > 0 and t != UNATTRIBUTED}
    present = tuple(t for t in tiers.order if t in stated)
    return TierView(engine, nodes, present, _churn(present, facts, capacity, request_tokens))


def _stated(engine: str, facts: dict[str, str]) -> tuple[str, ...]:
    """Return the tiers a node's stated settings say it has."""
    if engine == "reference":
        return tuple(t for t in facts.get("cache_tiers", "").split(",") if t)
    if engine == "sglang":
        host = facts.get("enable_hierarchical_cache", "").lower() == "true"
        storage = facts.get("hicache_storage_backend", "None") not in ("None", "")
        return ("device",) + (("host",) if host else ()) + (("storage",) if storage else ())
    return ("device",)


def _churn(
    present: tuple[str, ...], facts: dict[str, str], capacity: ServerCapacity | None, request_tokens: int
) -> dict[str, int]:
    """Return, for each tier that has one below it, the fresh requests that push a prefix out of it:
    the ring's slots (and one more) for the reference worker's session cache, the KV pool's tokens
    over one request's (and one more) for a tier of accelerator pages; others are not known."""
    churn: dict[str, int] = {}
    for tier in present[:-1]:
        if tier == "session" and (slots := facts.get("session_cache", "")).isdigit():
            churn[tier] = int(slots) + 1
        elif tier in ("prefix", "device") and capacity is not None and capacity.kv_pool_tokens:
            churn[tier] = math.ceil(capacity.kv_pool_tokens / max(1, request_tokens)) + 1
    return churn


async def read_tiers(ctx: ProbeContext, nodes: tuple[Node, ...]) -> dict[str, float] | None:
    """Return the tokens each tier served so far, summed over ``nodes``; None when a page cannot be read."""
    total: dict[str, float] = {}
    for node in nodes:
        scraped = await ctx.target.scrape(node.metrics_url)
        if scraped.samples is None:
            return None
        for tier, tokens in (tier_tokens(ctx.target.engine, scraped.samples) or {}).items():
            total[tier] = total.get(tier, 0.0) + tokens
    return total


async def served_by(
    ctx: ProbeContext, view: TierView, before: dict[str, float] | None, cached: int
) -> Served:
    """Return the tiers that served a request answered with ``cached`` tokens since ``before`` was read."""
    if before is None:
        return Served(None, False)
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        after = await read_tiers(ctx, view.nodes)
        if after is None:
            return Served(None, False)
        moved = {t: round(after.get(t, 0.0) - before.get(t, 0.0)) for t in set(after) | set(before)}
        moved = {t: n for t, n in moved.items() if n}
        if sum(moved.values()) == cached:
            return Served(moved, True)
        if sum(moved.values()) > cached or time.monotonic() >= deadline:
            return Served(moved, False)
        await asyncio.sleep(0.1)
