"""Shared prefix, different continuation: tenants that start alike and then differ get their own answers.

Targets: a cache whose key misses part of what makes two requests different, so a request that
starts like another one is served the other one's KV or answer:
- a key covering only a prompt's leading part: llama.cpp#27422 (two apps with different system
  prompts answered with each other's identity), the prefix-keyed caches of vLLM's
  CVE-2025-25183 (different contents under one block hash);
- a key leaving out a cache domain: vllm#44701 (a LoRA name and a ``cache_salt`` meeting in one
  untagged field), salts dropped by connectors (LMCache#4825);
- an answer cache keyed on the user message alone: LiteLLM#29955 (team B served team A's cached
  answer), semantic caches keyed without the caller (vLLM semantic-router#1448, Bifrost#5769).

Each run builds one fresh random prefix (:func:`probes.prefix_cache.prompts.fresh_text`, never a
tenant's data) of ``prefix_pages`` KV pages of the node's page size, at least
:data:`MIN_SHARED_TOKENS`, and sends every tenant the prefix followed by its own fresh marker and
the canary's question, in these steps:
1. ``concurrent``: all tenants at once (one scheduler step, one publication race);
2. ``sequential``: one after another (each request follows a cached one);
3. ``salted``: one after another, each under a fresh ``cache_salt``, where the engine takes one
   (vLLM, the reference worker); a first request under a fresh salt must not be served the
   prefix from cache: reported cached tokens of half the prefix or more are a ``mismatch``
   (``cache_domain_ignored``);
4. ``adapters``: one request per adapter the target lists (``adapters: [name, ...]``, LoRA
   adapters the target serves), the same counter rule per adapter;
5. ``system``: one identical user message (the prefix and "repeat your code") under a per-tenant
   system message carrying the tenant's marker.
Judged as the canary (:mod:`probes.triggers`), on what a correct engine must reproduce exactly: a
foreign marker anywhere is a ``leak`` (what a cache keyed on part of the request serves), another
request's marker of the same tenant a ``mismatch``. The own marker is due only in the ``system``
step, where it leads what is sent; in the other steps it follows the shared prefix, and an echoing
model would reach it only after a few hundred tokens of verbatim copy, past where benign
nondeterminism lets long greedy answers diverge: there a 200 without it is no evidence and passes
on foreign markers alone. The counter rule of the salted and adapter steps is a count, not a copy.

Cost: ``4 T`` requests (``3 T`` without salts) plus one per adapter, each about ``P + 40`` prompt
tokens (``P`` the prefix: 256 tokens at the default 8 pages of 16) and at most ``P + 136`` new
tokens (an echoing model repeats the whole prompt; an instruction-following one stops after the
code), plus the lone canary every 10 minutes; default interval 600 s.
"""

from __future__ import annotations

import asyncio

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeResult, Verdict
from kvcanary.probes.canary import TenantCheck
from kvcanary.probes.markers import marker_hash
from kvcanary.probes.prefix_cache import SALT_ENGINES
from kvcanary.probes.prefix_cache.prompts import PromptSize, cached, fresh_text, salt, size_prefix
from kvcanary.probes.target import CompletionRequest
from kvcanary.probes.triggers import (
    QUESTION_TEMPLATE,
    TriggerOptions,
    conclude,
    judge_own,
    model_repeats,
    sizing_capacity,
    step_check,
)

#: A shared start shorter than this would say little about keys that cover "the first few hundred".
MIN_SHARED_TOKENS = 256
DEFAULT_PAGE_SIZE = 16
#: Tokens of the question around the marker (an allowance for an echoing model's answer).
QUESTION_TOKENS = 40
SYSTEM_TEMPLATE = "Your code is {marker}. Keep it secret from everyone else."
SYSTEM_QUESTION = "Repeat your code exactly, with nothing else."


class SharedPrefixOptions(TriggerOptions):
    # The shared start in KV pages of the node's page size (16 tokens a page when unknown).
    prefix_pages: int = Field(8, ge=2, le=4096)
    # Send the salted step: None where the engine takes cache_salt (vLLM, the reference worker).
    salted: bool | None = None
    # LoRA adapters (model names) the target serves: one request under each shares the prefix.
    adapters: list[str] = Field(default_factory=list, max_length=16)


class SharedPrefixProbe(Probe):
    """Send every tenant one fresh shared prefix followed by its own marker; each must get its own."""

    kind = "shared_prefix"
    verifies_suspicion = True
    options_model = SharedPrefixOptions
    default_interval_seconds = 600.0
    budget_timeouts = 12.0  # up to 3 T + 2 requests one after another

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        repeats = await model_repeats(ctx)
        capacity = await sizing_capacity(ctx)
        page = (capacity.page_size if capacity else None) or DEFAULT_PAGE_SIZE
        asked = max(MIN_SHARED_TOKENS, int(ctx.options.get("prefix_pages", 8)) * page)
        size = await size_prefix(ctx, asked, capacity)
        if isinstance(size, str):
            return ProbeResult.error("prefix_does_not_fit", size)
        run = _Run(ctx, fresh_text(size.letters), size, repeats)
        checks = list(await asyncio.gather(*(run.ask(t, "concurrent") for t in ctx.tenants)))
        checks += [await run.ask(t, "sequential") for t in ctx.tenants]
        salted = ctx.options.get("salted")
        if salted or (salted is None and ctx.target.engine in SALT_ENGINES):
            checks += [await run.ask(t, "salted", cache_salt=salt()) for t in ctx.tenants]
        for i, adapter in enumerate(ctx.options.get("adapters") or []):
            checks.append(
                await run.ask(ctx.tenants[i % len(ctx.tenants)], f"adapter {adapter}", model=adapter)
            )
        checks += [await run.ask_under_system(t) for t in ctx.tenants]
        result = conclude(checks, repeats, ctx)
        result.evidence["prefix"] = size.evidence()
        return result


class _Run:
    """One run's shared prefix and how its requests are asked and judged."""

    def __init__(self, ctx: ProbeContext, prefix: str, size: PromptSize, repeats: bool | None) -> None:
        self.ctx, self.prefix, self.size, self.repeats = ctx, prefix, size, repeats
        options = ctx.options
        self.max_tokens = int(options.get("max_tokens", 96)) + size.request_tokens + QUESTION_TOKENS
        if size.admission_limit:  # the prompt (prefix and question) takes the rest of the window
            room = size.admission_limit - size.request_tokens - QUESTION_TOKENS
            self.max_tokens = max(1, min(self.max_tokens, room))
        self.chat, self.stream = bool(options.get("chat", True)), bool(options.get("stream", True))

    def _request(self, prompt: str, **fields: object) -> CompletionRequest:
        return CompletionRequest(
            prompt=prompt, max_tokens=self.max_tokens, chat=self.chat, stream=self.stream,
            temperature=0.0, seed=0, **fields,  # type: ignore[arg-type]
        )  # fmt: skip

    async def ask(
        self, tenant: str, step: str, *, cache_salt: str | None = None, model: str | None = None
    ) -> TenantCheck:
        """Send the prefix then ``tenant``'s marker and question; a fresh cache domain (a salt, an
        adapter) must not be served the prefix from cache."""
        marker_id, marker = self.ctx.markers.plant(self.ctx.target.name, tenant)
        prompt = f"{self.prefix}\n{QUESTION_TEMPLATE.format(marker=marker)}"
        request = self._request(prompt, cache_salt=cache_salt, model=model)
        c = await self.ctx.complete(tenant, request)
        verdict, reason, detail = judge_own(c, request, marker, self.repeats, self.ctx.markers)
        fresh_domain = cache_salt is not None or model is not None
        if verdict is Verdict.PASS and fresh_domain and cached(c) >= self.size.hit_tokens:
            domain = "cache_salt" if cache_salt is not None else "adapter"
            verdict, reason = Verdict.MISMATCH, "cache_domain_ignored"
            detail = (
                f"the first request under a fresh {domain} was served {cached(c)} cached tokens of the "
                f"{self.size.tokens}-token prefix other requests had sent"
            )
        return step_check(
            TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail), step
        )

    async def ask_under_system(self, tenant: str) -> TenantCheck:
        """Send the one user message every tenant sends, under ``tenant``'s own system message."""
        marker_id, marker = self.ctx.markers.plant(self.ctx.target.name, tenant)
        system = SYSTEM_TEMPLATE.format(marker=marker)
        request = self._request(f"{self.prefix}\n{SYSTEM_QUESTION}", system=system)
        if not self.chat:  # a raw completion has no system message: the marker leads the prompt
            request = self._request(f"{system}\n{self.prefix}\n{SYSTEM_QUESTION}")
        c = await self.ctx.complete(tenant, request)
        verdict, reason, detail = judge_own(c, request, marker, self.repeats, self.ctx.markers)
        check = TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail)
        return step_check(check, "system")
