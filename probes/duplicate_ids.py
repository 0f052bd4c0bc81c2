"""Duplicate request ids: tenants that send the same client request id at once each get their own answer.

Targets: an engine or gateway that keys a request's state or output by the id the client gave it.
SGLang's tokenizer manager kept one state per ``rid`` (sgl-project/sglang#24223): a second request
with an id already in flight overwrote the first's state, and the first request's tokens were
streamed to the second client, which answered HTTP 200 with another tenant's text; the first
client waited for an answer that never came. Clients reuse ids more than one would think: retries
with the same id, SDKs that derive ids from a session, gateways that forward ``X-Request-Id``.

Each run sends, concurrently, one canary request per tenant (``probes/canary.py``: repeat a sealed
nonce) carrying the same fresh id (a UUID, the one shape every engine takes) in every place
engines read one: the ``X-Request-Id`` header, the body's ``user`` and, to SGLang and the
reference worker, the body's ``rid``. Judged as the
canary: a foreign marker in any answer is a ``leak`` (``probes.base.judge``), a 200 without the
tenant's own nonce a ``mismatch``; a tenant left without an answer is an ``error`` (the other
tenant's answer then says whether it took that tenant's tokens). Where the model does not repeat
(a lone canary says so, :mod:`probes.triggers`), foreign markers alone are judged.

The defect acts only on requests in flight together. The requests leave at once, but an engine
may finish one tenant's tiny answer before it reads the other's request (a loaded host): that run
sees nothing, and a defect that is there shows within a few runs.

Cost: ``T`` tiny completions at once (the canary's prompt, at most 96 new tokens) per run, plus
the lone canary every 10 minutes; default
interval 300 s (about 12 ``T`` requests an hour per target).
"""

from __future__ import annotations

import asyncio
import uuid

from kvcanary.probes.base import Probe, ProbeContext, ProbeResult
from kvcanary.probes.canary import TenantCheck, canary_request, repeat_prompt
from kvcanary.probes.markers import marker_hash
from kvcanary.probes.triggers import TriggerOptions, conclude, judge_own, model_repeats


class DuplicateIdsProbe(Probe):
    """Send every tenant's canary at once under one shared client request id."""

    kind = "duplicate_ids"
    verifies_suspicion = True
    options_model = TriggerOptions
    default_interval_seconds = 300.0

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        repeats = await model_repeats(ctx)
        # A UUID: llama-cpp-python's server refuses any other X-Request-Id with an empty 400.
        shared = str(uuid.uuid4())
        checks = await asyncio.gather(*(self._check(ctx, tenant, shared, repeats) for tenant in ctx.tenants))
        result = conclude(list(checks), repeats, ctx)
        result.evidence["request_id"] = shared
        return result

    async def _check(self, ctx: ProbeContext, tenant: str, shared: str, repeats: bool | None) -> TenantCheck:
        marker_id, marker = ctx.markers.plant(ctx.target.name, tenant)
        request = canary_request(ctx, repeat_prompt(marker), request_id=shared)
        c = await ctx.complete(tenant, request)
        # The prompt-token check is the canary's; here the question is whose answer came back.
        verdict, reason, detail = judge_own(c, request, marker, repeats, ctx.markers)
        return TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail)
