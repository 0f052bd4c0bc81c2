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

Only what a correct engine must reproduce exactly is judged, so benign drift never pages: another
request's marker anywhere (it can come back only from that request's KV, cache entry or answer:
never by chance), and the request's own marker only where it is **due** (:func:`own_marker_due`):
the request asks for it back and it sits within the first :data:`OWN_MARKER_HORIZON_CHARS`
characters of what the request sends. A copy model writes those before its 100th token, where the
greedy answers of real engines start to diverge (batch nondeterminism), and an instruction model
writes the code first anyway; a marker further in (after a shared prefix, say) would come back
only through a long verbatim repetition, which a correct engine need not give. Wrapping (``Sure:``,
quotes) cannot hide a marker that is there, and a failed request is an ``error``, never a verdict.
"""

from __future__ import annotations

import time
from typing import Any

from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict, unjudgeable
from kvcanary.probes.canary import (
    CanaryOptions,
    CanaryProbe,
    TenantCheck,
    canary_request,
    combine,
    judge_answer,
    repeat_prompt,
)
from kvcanary.probes.cross_tenant import CAPACITY_MAX_AGE_SECONDS
from kvcanary.probes.markers import MARKER_RE, MarkerBook, marker_hash
from kvcanary.probes.target import Completion, CompletionRequest, ServerCapacity

#: How long one lone canary's answer (does the model repeat?) is trusted: it changes with the model.
REPEATS_TTL_SECONDS = 600.0
#: The marker first, then the question: the rest of an answer abandoned after a few tokens still
#: carries the marker, and a cache serving a request's leading pages from another request serves
#: the whole marker (a prompt's last page is always computed, and the question fills it).
QUESTION_TEMPLATE = "Remember this code: {marker}\nRepeat the code exactly, with nothing else."
#: How far into what a request sends (system message, earlier turns, prompt) its own marker may end
#: and still be due back: the canary's whole prompt is 90 characters.
OWN_MARKER_HORIZON_CHARS = 96
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


def sent_text(request: CompletionRequest) -> str:
    """Return what ``request`` sends, in the order a copy model writes it back: the system message,
    the earlier turns, the prompt, one per line."""
    parts = [request.system] if request.system else []
    return "\n".join([*parts, *(text for _, text in request.history), request.prompt])


def own_marker_due(request: CompletionRequest, marker: str) -> bool:
    """Return whether a correct engine must write ``marker`` back for ``request``: it ends within
    the first :data:`OWN_MARKER_HORIZON_CHARS` characters of what the request sends (the caller
    knows whether the request asks for it at all)."""
    at = sent_text(request).find(marker)
    return at >= 0 and at + len(marker) <= OWN_MARKER_HORIZON_CHARS


#: A 2xx answer cut short on its way (the request's timeout, a broken stream): what came of it is
#: still the engine's output for this request, so another request's marker in it is evidence at any
#: pace (a follower handed an abandoned answer of 4,096 tokens ran past its timeout on a loaded
#: machine, and the run's own verdict was an error beside the runner's leak).
CUT_SHORT = frozenset({"timeout", "stream_error"})


def judge_own(
    c: Completion,
    request: CompletionRequest,
    marker: str,
    repeats: bool | None,
    book: MarkerBook,
    *,
    asked: bool = True,
) -> tuple[Verdict, str, str]:
    """Judge one answer as the canary does, and more strictly: an answer must carry no marker but
    its own. Another tenant's is a leak (``ctx.complete`` found it); another of its own tenant's
    markers (one given to another request) a ``mismatch``: another request's K/V or answer came
    back, within the tenant.

    The own marker is judged only where it is due: ``asked`` (the request asks for it back) and
    early in what was sent (:func:`own_marker_due`), and where the model repeats. Otherwise a
    judgeable 2xx with no other marker passes, saying why; where nobody knows whether the model
    repeats (the lone canary got no answer and none was kept), a missing own marker is an
    ``error``, not a mismatch."""
    others = live_markers(c.text, book) - {"KVC-" + marker[4:].lower()}
    why = unjudgeable(c)
    if others and (why is None or (c.ok and why in CUT_SHORT)):
        detail = f"the answer carries {len(others)} marker(s) given to other requests"
        if why is not None:
            detail += f" in the {len(c.text)} characters read before it was cut short ({why})"
        return Verdict.MISMATCH, "other_request_marker", detail
    due = asked and own_marker_due(request, marker)
    if (repeats is False or not due) and why is None and c.ok:
        why = "the model does not repeat" if repeats is False else _not_due(asked)
        return Verdict.PASS, "no_foreign_marker", f"no foreign marker ({why})"
    verdict, reason, detail = judge_answer(c, request.prompt, marker, None)
    if repeats is None and reason == "nonce_missing":
        return Verdict.ERROR, "repeats_unknown", "no own marker, and whether this model repeats is unknown"
    return verdict, reason, detail


def _not_due(asked: bool) -> str:
    if not asked:
        return "own marker not judged: the request does not ask for it back"
    return (
        f"own marker not judged: it sits past the first {OWN_MARKER_HORIZON_CHARS} characters sent, "
        "where only a long verbatim copy would bring it back"
    )


def conclude(checks: list[TenantCheck], repeats: bool | None, ctx: ProbeContext) -> ProbeResult:
    """Return the run's result: the worst check decides; the evidence says how answers were judged."""
    result = combine(checks)
    result.evidence["judged"] = FOREIGN_ONLY if repeats is False else OWN_AND_FOREIGN
    intact = sum(c.reason == "nonce_intact" for c in checks)
    if result.verdict is Verdict.PASS and intact:  # the strongest pass a run has is its own
        result.reason = "nonce_intact"
        result.detail = (
            f"own markers back intact in {intact} answer(s) where due; no foreign marker in any of "
            f"{len(checks)}"
        )
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
    request = canary_request(ctx, repeat_prompt(marker))
    c = await ctx.complete(tenant, request)
    verdict, reason, detail = judge_own(c, request, marker, repeats, ctx.markers)
    return step_check(
        TenantCheck(tenant, marker_id, marker_hash(marker), None, c, verdict, reason, detail), step
    )


def step_check(check: TenantCheck, step: str) -> TenantCheck:
    """Return ``check`` labelled with the step of the run it belongs to (kept in its evidence)."""
    check.step = step
    check.detail = f"{step}: {check.detail}"
    return check
