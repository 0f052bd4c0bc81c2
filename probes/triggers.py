"""What the trigger kinds share: canary-shaped requests, judged as the canary judges, with a control.

The trigger kinds (``duplicate_ids``, ``shared_prefix``, ``hangup``) recreate what customers did
when real engines leaked (``docs/real-bugs.md``): every request asks its tenant's model to
repeat a fresh sealed marker, and a foreign marker in any answer is a ``leak`` (``probes.base.judge``,
whatever else the run concluded).

Losing the tenant's *own* marker is a ``mismatch`` only where the model can repeat one. A model
that cannot (a random-weight test model, a base model that rambles) would make every run a
mismatch and teach operators to ignore the kind. So a run first asks a **lone canary** (one
tenant, one request, nothing else in flight from this run): if it comes back without its nonce,
the model does not repeat, and the run judges foreign markers only and says so (``judged:
foreign_markers_only`` in the evidence, reason ``no_foreign_marker`` on a pass). The control's
answer is kept for :data:`REPEATS_TTL_SECONDS` in the kind's state; an answer holding some other
marker than its own shows a model that repeats (something else went wrong: judging stays
strict). An operator who knows may state ``repeats: true`` or ``false`` and skip the control. A
lone canary that fails for the incident's reasons (a stale decode) also reads as "does not
repeat": the ``canary`` kind reports that fault itself, and these kinds still catch what crosses
tenants.
"""

from __future__ import annotations

import time
from typing import Any

from probes.base import ProbeContext, ProbeResult, Verdict, unjudgeable
from probes.canary import (
    CanaryOptions,
    CanaryProbe,
    TenantCheck,
    canary_request,
    combine,
    judge_answer,
    repeat_prompt,
)
from probes.cross_tenant import CAPACITY_MAX_AGE_SECONDS
from probes.markers import MARKER_RE, MarkerBook, marker_hash
from probes.target import Completion, ServerCapacity

#: How long one lone canary's answer (does the model repeat?) is trusted: it changes with the model.
REPEATS_TTL_SECONDS = 600.0
#: The marker first, then the question: the rest of an answer abandoned after a few tokens still
#: carries the marker, and a cache serving a request's leading pages from another request serves
#: the whole marker (a prompt's last page is always computed, and the question fills it).
QUESTION_TEMPLATE = "Remember this code: {marker}\nRepeat the code exactly, with nothing else."
FOREIGN_ONLY = "foreign_markers_only"
OWN_AND_FOREIGN = "own_and_foreign_markers"


class TriggerOptions(CanaryOptions):
    # Whether the model repeats a nonce when asked: None asks a lone canary (kept 10 minutes).
    repeats: bool | None = None


async def sizing_capacity(ctx: ProbeContext) -> ServerCapacity | None:
    """Return the node's capacity as the trigger kinds size their requests by it: one reading, up
    to :data:`~probes.cross_tenant.CAPACITY_MAX_AGE_SECONDS` old (the audits read it afresh)."""
    return await ctx.target.capacity(max_age=CAPACITY_MAX_AGE_SECONDS)


def _remembered(state: dict[str, Any], now: float, *, any_age: bool = False) -> bool | None:
    repeats, at = state.get("repeats"), state.get("repeats_checked_at")
    if not isinstance(repeats, bool) or not isinstance(at, int | float):
        return None
    return repeats if any_age or 0 <= now - at < REPEATS_TTL_SECONDS else None


def live_markers(text: str, book: MarkerBook) -> set[str]:
    """Return the live markers of ``book`` in ``text``, lower-cased: a copy a model got wrong, or
    text merely shaped like a marker, is none (only a sealed, unexpired marker came from a request)."""
    found = {"KVC-" + m.group(0)[4:].lower() for m in MARKER_RE.finditer(text)}
    return {m for m in found if book.is_live(m)}


async def model_repeats(ctx: ProbeContext) -> bool | None:
    """Return whether the target's model repeats a nonce: stated, remembered, or asked of a lone
    canary now. None when the lone canary got no answer to judge (the run then judges strictly)."""
    stated = ctx.options.get("repeats")
    if isinstance(stated, bool):
        return stated
    remembered = _remembered(ctx.state, time.time())
    if remembered is not None:
        return remembered
    check = await CanaryProbe().check(ctx, ctx.tenants[0])
    # A model that cannot repeat writes no live marker; one that wrote another live marker than its
    # own repeats, and something else went wrong: judge strictly.
    if check.verdict is Verdict.PASS or live_markers(check.completion.text, ctx.markers):
        return True
    if check.reason == "nonce_missing":
        return False
    # No answer to judge (a timeout, a 5xx): the last answer, however old, rather than none.
    return _remembered(ctx.state, time.time(), any_age=True)


def judge_own(
    c: Completion, prompt: str, marker: str, repeats: bool | None, book: MarkerBook
) -> tuple[Verdict, str, str]:
    """Judge one answer as the canary does, and more strictly: an answer must carry no marker but
    its own. Another tenant's is a leak (``ctx.complete`` found it); another of its own tenant's
    markers (one given to another request) a ``mismatch``: another request's K/V or answer came
    back, within the tenant. Where the model does not repeat, a judgeable 2xx with no such marker
    passes, saying why; where nobody knows (the lone canary got no answer and none was kept), a
    missing own marker is an ``error``, not a mismatch."""
    others = live_markers(c.text, book) - {"KVC-" + marker[4:].lower()}
    if others and unjudgeable(c) is None:
        detail = f"the answer carries {len(others)} marker(s) given to other requests"
        return Verdict.MISMATCH, "other_request_marker", detail
    if repeats is False and unjudgeable(c) is None and c.ok:
        return Verdict.PASS, "no_foreign_marker", "no foreign marker (the model does not repeat)"
    verdict, reason, detail = judge_answer(c, prompt, marker, None)
    if repeats is None and reason == "nonce_missing":
        return Verdict.ERROR, "repeats_unknown", "no own marker, and whether this model repeats is unknown"
    return verdict, reason, detail


def conclude(checks: list[TenantCheck], repeats: bool | None, ctx: ProbeContext) -> ProbeResult:
    """Return the run's result: the worst check decides; the evidence says how answers were judged."""
    result = combine(checks)
    result.evidence["judged"] = FOREIGN_ONLY if repeats is False else OWN_AND_FOREIGN
    if result.verdict is Verdict.PASS and repeats is False:
        result.reason = "no_foreign_marker"
        result.detail = (
            "no foreign marker in any answer; own markers not judged: a lone canary came back "
            "without its nonce, so this model does not repeat"
        )
    if (
        repeats is not None
        and ctx.options.get("repeats") is None
        and _remembered(ctx.state, time.time()) is None
    ):
        result.state = {"repeats": repeats, "repeats_checked_at": time.time()}
    return result


async def canary_check(ctx: ProbeContext, tenant: str, step: str, repeats: bool | None) -> TenantCheck:
    """Send ``tenant`` a canary (:mod:`probes.canary`'s request) as ``step`` of a run and judge it."""
    marker_id, marker = ctx.markers.plant(ctx.target.name, tenant)
    prompt = repeat_prompt(marker)
    c = await ctx.complete(tenant, canary_request(ctx, prompt))
    verdict, reason, detail = judge_own(c, prompt, marker, repeats, ctx.markers)
    return step_check(
        TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail), step
    )


def step_check(check: TenantCheck, step: str) -> TenantCheck:
    """Return ``check`` labelled with the step of the run it belongs to (kept in its evidence)."""
    check.step = step
    check.detail = f"{step}: {check.detail}"
    return check
