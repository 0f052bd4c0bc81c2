"""Cross-tenant: does one tenant's text ever come back to another?

Targets: KV pages that outlive their owner's request and reach another tenant's decode: stale
pages reused without being overwritten (the incident), prefix-cache entries shared across tenants
without a salt, or late KV writes landing in pages already handed on (SGLang #24527). The probe
fills the KV cache with each tenant's markers and asks as every tenant, first all at once (the
batch is where tenants share a scheduler step and a free list) and then one after another (each
reader right behind the others' freshly freed pages), and looks for any other tenant's marker in
any answer.

Why the check is sound: every marker is sealed by the shared :class:`~probes.markers.MarkerBook`
with a 64-bit MAC under the monitor's key, and :class:`~probes.base.ProbeContext` scans every response
(generated text and error bodies) against the live markers of the other tenants. A match cannot
come from nondeterminism or a lucky guess (2**-64), so any match is a ``leak``; no match is a
``pass`` only when every planting request was answered, so that the markers were in the cache.

A planting prompt spans many KV pages (16 pages' worth, from the node's ``page_size`` when known;
one reading serves ten minutes of runs, and a refused plant reads it again) and repeats its marker
every 60 characters, so a stale read of a few pages in order holds a whole marker. It stays well
under the node's admission limit, shared by every tenant's request in the concurrent round: this
probe must not itself trip the over-capacity path that the boundary probe tests.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict
from kvcanary.probes.canary import MAX_TOKENS, repeat_prompt
from kvcanary.probes.markers import redact_markers
from kvcanary.probes.target import Completion, CompletionRequest

#: Pages a planting prompt should span, so that markers land in many pages of the pool.
PLANT_PAGES = 16
#: Characters per token assumed when sizing a prompt from a page size (BPE text runs ~4).
CHARS_PER_TOKEN = 4
#: Planting prompt size when the page size is unknown: 16 pages of 16 tokens on a BPE model.
DEFAULT_PLANT_CHARS = 1536
#: Tokens a stated planting size stays below the admission limit (chat template, tokenizer slack).
PLANT_HEADROOM = 64
#: Below this share of reads answered there is too little output to say that nothing leaked.
MIN_READ_SHARE = 0.5
#: How long one reading of the node's page size and admission limit sizes the plants: they change
#: only when the engine restarts with another configuration, and a refused plant reads them again.
CAPACITY_MAX_AGE_SECONDS = 600.0
_PLANT_HEAD = "Keep these reference codes on file and reply with OK.\n"
_PLANT_MAX_TOKENS = 8


def plant_prompt(marker: str, chars: int) -> str:
    """Return a prompt of at most ``chars`` characters (one line at least) that repeats ``marker``."""
    lines = [_PLANT_HEAD]
    size, i = len(_PLANT_HEAD), 0
    while True:
        line = f"{marker} is entry {i:03d}.\n"
        if i and size + len(line) > chars:
            return "".join(lines)
        lines.append(line)
        size, i = size + len(line), i + 1


def plant_chars(page_size: int | None, admission_limit: int | None, tenants: int, stated: int = 0) -> int:
    """Return the planting prompt size in characters (``stated``: the operator's ``plant_chars``).

    Every tenant plants and reads at once in the concurrent round, so a computed size gets at most a
    ``2 * tenants``-th of the admission limit, counted as if one character were one token (byte
    tokenizers, like the reference worker's): the round fits one request's worth of pool and stays
    one batch. A stated size may be larger, but never within :data:`PLANT_HEADROOM` of the limit:
    this probe must stay under capacity (the boundary probe tests over it).
    """
    if stated > 0:
        chars = stated
    else:
        chars = PLANT_PAGES * page_size * CHARS_PER_TOKEN if page_size else DEFAULT_PLANT_CHARS
        if admission_limit:
            chars = min(chars, admission_limit // (2 * max(tenants, 1)))
    if admission_limit:
        chars = min(chars, admission_limit - PLANT_HEADROOM)
    return max(chars, 1)


class CrossTenantOptions(ProbeOptions):
    # Characters per planted prompt; default: about 16 KV pages, capped by the node's limit.
    plant_chars: int | None = Field(None, ge=64, le=10_000_000)


class CrossTenantProbe(Probe):
    """Plant every tenant's markers in the KV cache, read as every tenant, and look for foreign ones."""

    kind = "cross_tenant"
    verifies_suspicion = True
    min_tenants = 2
    options_model = CrossTenantOptions

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        tenants = list(ctx.tenants)
        if len(tenants) < 2:
            return ProbeResult.error("too_few_tenants", "a cross-tenant probe needs two or more tenants")
        capacity = await ctx.target.capacity(max_age=CAPACITY_MAX_AGE_SECONDS)
        chars = plant_chars(
            capacity.page_size if capacity else None,
            capacity.admission_limit if capacity else None,
            len(tenants),
            stated=int(ctx.options.get("plant_chars") or 0),
        )
        # All at once: the requests share a batch, a scheduler step and the free list.
        batch = await asyncio.gather(
            *(self._plant(ctx, t, chars) for t in tenants), *(self._read(ctx, t) for t in tenants)
        )
        plants, reads = list(batch[: len(tenants)]), list(batch[len(tenants) :])
        # Then one after another: each reader follows every other tenant's freshly freed pages, and
        # the run ends with the free list in a known order (LIFO: the last tenant's pages in front),
        # so a later stale read meets long runs of one tenant's pages, not a shuffle of the batch.
        plants += [await self._plant(ctx, t, chars) for t in tenants]
        reads += [await self._read(ctx, t) for t in tenants]
        if any(c.status is not None and 400 <= c.status < 500 for c in plants):
            await ctx.target.capacity()  # perhaps a smaller limit since the last reading: read it again
        return _conclude(plants, reads, chars)

    async def _plant(self, ctx: ProbeContext, tenant: str, chars: int) -> Completion:
        _, marker = ctx.markers.plant(ctx.target.name, tenant)
        request = CompletionRequest(plant_prompt(marker, chars), max_tokens=_PLANT_MAX_TOKENS, stream=False)
        return await ctx.complete(tenant, request)

    async def _read(self, ctx: ProbeContext, tenant: str) -> Completion:
        # The reader's own fresh marker: a short, self-referential task, and one more live marker
        # that must never reach the others.
        _, marker = ctx.markers.plant(ctx.target.name, tenant)
        request = CompletionRequest(repeat_prompt(marker), max_tokens=MAX_TOKENS, stream=True)
        return await ctx.complete(tenant, request)


def _conclude(plants: list[Completion], reads: list[Completion], chars: int) -> ProbeResult:
    plants_ok = sum(c.answered for c in plants)
    reads_ok = sum(c.answered for c in reads)
    measurements: dict[str, float] = {
        "requests_sent": len(plants) + len(reads),
        "requests_answered": plants_ok + reads_ok,
        "plants_answered": plants_ok,
        "reads_answered": reads_ok,
        "plant_prompt_chars": chars,
    }
    latencies = [c.latency_seconds for c in plants + reads if c.latency_seconds is not None]
    if latencies:
        measurements["latency_seconds"] = max(latencies)
    evidence: dict[str, Any] = {"failures": _failures(plants + reads)}
    if plants_ok < len(plants):
        detail = f"{len(plants) - plants_ok} of {len(plants)} planting requests got no answer"
        return ProbeResult(Verdict.ERROR, "plants_unanswered", detail, evidence, measurements)
    if reads_ok < MIN_READ_SHARE * len(reads):
        detail = f"only {reads_ok} of {len(reads)} reads were answered: too little output to judge"
        return ProbeResult(Verdict.ERROR, "reads_unanswered", detail, evidence, measurements)
    detail = f"no foreign marker in {plants_ok + reads_ok} answers (plants of {chars} characters)"
    return ProbeResult(Verdict.PASS, "no_foreign_marker", detail, {}, measurements)


def _failures(completions: list[Completion]) -> list[dict[str, Any]]:
    """Return up to 8 unanswered requests, in words (status, kind, redacted message)."""
    return [
        {"status_code": c.status, "error_kind": c.error_kind, "error": redact_markers(c.error or "")[:200]}
        for c in completions
        if not c.answered
    ][:8]
