"""The paired salt check of the ``prefix_cache`` probe: by body, by header, tier by tier.

A salt isolates only if both halves hold (vLLM pull request #53347): the same salt must hit (else
nothing is cached under salts, and a miss says nothing) and a different salt must miss (else the
salt does not separate). "No hit" alone also passes with caching off, hence the pair. The check runs
once the counter test showed that caching works and is reported; one tenant sends fresh prefixes:

1. **Body** (vLLM's ``cache_salt``): P under salt S1, again under S1, once under S2. A hit under S2
   is a ``mismatch`` (``cache_salt_ignored``): another salt's cached K/V served, which across tenants
   is a leak of what they sent, certain (cached tokens of a fresh random prefix only this request's
   salt did not send). A miss under S1 is an ``error`` (``cache_salt_same_missed``, "cannot judge"):
   no data crossed, the salted request is only not reused, and the other half proves nothing then.
2. **Tiers** (:mod:`probes.prefix_cache.tiers`): each request's tokens by the tier that served them.
   A hit under another salt names the tier that dropped it; the same salt's hit says which tier was
   judged. A tier the node has below the one that served is reached on purpose: fresh prompts push P
   out of the tiers above it (as many as they hold: a session ring's slots, a pool's tokens), then
   P is sent under a new salt (must miss) and under S1 (must hit, in that tier). A tier never
   reached is an ``error`` (``cache_tier_not_exercised``): a pass needs every tier the node has
   judged on its own, since a salt honoured by the accelerator's pages says nothing of a connector's.
3. **Header**, where the engine takes the salt from a header a trusted gateway sets (the
   ``salt_header`` option or what the node states; NVIDIA Dynamo reads ``x-tenant-id`` before the
   body's salt, vLLM pull request #57609 proposes ``X-Cache-Salt``, both letting the header win):
   P under header H1, again under H1 (must hit: else ``cache_salt_header_unobservable``, an
   ``error``), under H2 (must miss: else ``cache_salt_header_ignored``), and under a fresh header H3
   with S1 in the body (must miss: else ``cache_salt_body_overrides_header``, a ``mismatch``, since a
   client then chooses its cache domain by writing another tenant's salt, which the header exists to
   prevent: dynamo#14803 found a route where the body won).

Cost: three requests, four more with a header, and per tier reached the fresh prompts that push P
out of the tiers above it plus two. Every request is one token of output on a fresh random prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcanary.probes.base import ProbeContext, ProbeResult, Verdict
from kvcanary.probes.engine_counters import UNATTRIBUTED
from kvcanary.probes.prefix_cache.prompts import (
    PromptSize,
    cache_request,
    cached,
    failure,
    fresh_text,
    row,
    salt,
    with_tail,
)
from kvcanary.probes.prefix_cache.tiers import Served, TierView, read_tiers, served_by
from kvcanary.probes.target import Completion

#: Findings in the order a run reports them: the first is its reason, the others join its detail.
MISMATCHES = ("cache_salt_ignored", "cache_salt_header_ignored", "cache_salt_body_overrides_header")
CANNOT_JUDGE = ("cache_salt_same_missed", "cache_salt_header_unobservable", "cache_tier_not_exercised")


@dataclass
class SaltCheck:
    """One run of the check: what it sends, what it saw, and what it found."""

    ctx: ProbeContext
    tenant: str
    size: PromptSize
    chat: bool
    view: TierView | None
    header: str | None
    #: Tiers below the first that the budget lets the check reach (by pushing P out of those above).
    reach: tuple[str, ...] = ()
    rows: list[dict[str, Any]] = field(default_factory=list)
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    found: dict[str, str] = field(default_factory=dict)
    failed: ProbeResult | None = None

    async def send(
        self, role: str, prompt: str, *, body: str | None = None, header: str | None = None
    ) -> tuple[Completion, Served] | None:
        """Send ``prompt`` under a body salt, a header salt, or both; return the answer and its tiers,
        or None once a request got no usable answer (``failed`` says why)."""
        view = self.view
        before = await read_tiers(self.ctx, view.nodes) if view is not None else None
        request = cache_request(prompt, chat=self.chat, stream=False, cache_salt=body)
        if header is not None and self.header is not None:
            request.headers = {self.header: header}
        c = await self.ctx.complete(self.tenant, request)
        served = Served(None, False)
        if view is not None:
            served = (await served_by(self.ctx, view, before, cached(c))).or_only_tier(view, cached(c))
        self.rows.append({**row(role, self.tenant, c), **served.evidence()})
        why = failure(c)
        if why is None:
            return c, served
        detail = f"the {role} request got no usable answer ({why}: {c.error or f'HTTP {c.status}'})"
        if why == "refused":
            why, detail = ("cache_salt_refused", f"the engine refused a cache salt ({role}): {c.error}")
        self.failed = ProbeResult(Verdict.ERROR, why, detail)
        return None

    def tier(self, name: str) -> dict[str, Any]:
        return self.tiers.setdefault(
            name, {"present": name in (self.view.present if self.view else ()), "verdict": "not_exercised"}
        )

    def judge_hit(self, served: Served, gain: int, finding: str, what: str, *, body: bool = True) -> None:
        """Record a request that must miss: any gain is ``finding``, each tier that served it named
        (and, for a body salt, marked as one that ignores salts: a header the engine does not read
        is no tier's fault)."""
        if gain <= 0:
            return
        for name in (served.tiers or {}) if served.attributed and body else ():
            self.tier(name)["verdict"] = "ignored"
            self.tier(name)[f"{what}_tokens"] = served.tokens(name)
        if finding not in self.found:
            where = sorted(served.tiers or {}) if served.attributed else []
            tiers = f" (served by {', '.join(where)})" if where else ""
            self.found[finding] = f"{what.replace('_', ' ')}: {gain} cached tokens{tiers}"

    def judge_same(self, served: Served, only: str | None = None) -> None:
        """Record a request that must hit: each tier (or ``only``) serving half the prefix is judged."""
        for name in (served.tiers or {}) if served.attributed else ():
            if only is not None and name != only:
                continue
            record = self.tier(name)
            record["same_salt_tokens"] = max(record.get("same_salt_tokens", 0), served.tokens(name))
            if served.tokens(name) >= self.size.hit_tokens and record["verdict"] == "not_exercised":
                record["verdict"] = "honoured"


async def run_salt_check(check: SaltCheck) -> ProbeResult:
    """Run the check (module docstring) and return its verdict, with its evidence."""
    prefix, s1, s2 = fresh_text(check.size.letters), salt(), salt()
    for tier in check.view.present if check.view is not None else ():
        check.tier(tier)
    gains = await _body_pair(check, prefix, s1, s2)
    if gains is not None and check.failed is None:
        same, _ = gains
        if same >= check.size.hit_tokens:
            await _lower_tiers(check, prefix, s1)
    if check.header is not None and check.failed is None:
        await _header(check, prefix, s1)
    if check.failed is not None:
        check.failed.evidence = _evidence(check, gains)
        return check.failed
    return _verdict(check, gains)


async def _body_pair(check: SaltCheck, prefix: str, s1: str, s2: str) -> tuple[int, int] | None:
    """Send P under S1, S1 and S2; return the gains of the second and third over the first."""
    answers = []
    for role, s in (("salt_cold", s1), ("salt_same", s1), ("salt_other", s2)):
        sent = await check.send(role, with_tail(prefix), body=s)
        if sent is None:
            return None
        answers.append(sent)
    (cold, _), (same, same_tiers), (other, other_tiers) = answers
    gain_same, gain_other = cached(same) - cached(cold), cached(other) - cached(cold)
    check.judge_same(same_tiers)
    check.judge_hit(other_tiers, gain_other, "cache_salt_ignored", "other_salt")
    if gain_same < check.size.hit_tokens and "cache_salt_same_missed" not in check.found:
        check.found["cache_salt_same_missed"] = f"the same salt gained only {gain_same} cached tokens"
    return gain_same, gain_other


async def _lower_tiers(check: SaltCheck, prefix: str, s1: str) -> None:
    """Reach each tier below the first that no request judged yet: push P out of the tiers above it,
    then send P under a new salt (must miss) and under S1 (must hit there)."""
    view = check.view
    if view is None:
        return
    for tier in check.reach:
        if check.tier(tier)["verdict"] != "not_exercised":
            continue
        above = view.present[: view.present.index(tier)]
        for i in range(max(view.churn[t] for t in above)):
            if await check.send(f"churn_{tier}_{i + 1}", with_tail(fresh_text(check.size.letters))) is None:
                return
        other = await check.send(f"{tier}_other", with_tail(prefix), body=salt())
        if other is None:
            return
        check.judge_hit(other[1], cached(other[0]), "cache_salt_ignored", "other_salt")
        same = await check.send(f"{tier}_same", with_tail(prefix), body=s1)
        if same is None:
            return
        check.judge_same(same[1], only=tier)


async def _header(check: SaltCheck, prefix: str, s1: str) -> None:
    """Send P under header H1, H1, H2, and a fresh H3 with S1 in the body (module docstring)."""
    h1, h2, h3 = salt(), salt(), salt()
    answers = []
    for role, h, body in (
        ("header_cold", h1, None),
        ("header_same", h1, None),
        ("header_other", h2, None),
        ("header_forged", h3, s1),
    ):
        sent = await check.send(role, with_tail(prefix), body=body, header=h)
        if sent is None:
            return
        answers.append(sent)
    (cold, _), (same, _), (other, other_tiers), (forged, forged_tiers) = answers
    base = cached(cold)
    if cached(same) - base < check.size.hit_tokens:
        gain = cached(same) - base
        check.found["cache_salt_header_unobservable"] = (
            f"the same header salt gained only {gain} cached tokens"
        )
    ignored, forged_gain = cached(other) - base, cached(forged) - base
    check.judge_hit(other_tiers, ignored, "cache_salt_header_ignored", "other_header", body=False)
    check.judge_hit(forged_tiers, forged_gain, "cache_salt_body_overrides_header", "forged_body", body=False)


def _verdict(check: SaltCheck, gains: tuple[int, int] | None) -> ProbeResult:
    """Return the check's verdict: any mismatch first, then anything it could not judge, else a pass."""
    evidence = _evidence(check, gains)
    same, other = gains if gains is not None else (0, 0)
    measurements = {"salt_same_cached_tokens": float(same), "salt_other_cached_tokens": float(other)}
    for kinds, verdict in ((MISMATCHES, Verdict.MISMATCH), (CANNOT_JUDGE, Verdict.ERROR)):
        said = [reason for reason in kinds if reason in check.found]
        if said:
            detail = "; ".join(f"{_MEANING[r]} ({check.found[r]})" for r in said)
            return ProbeResult(verdict, said[0], detail, evidence, measurements)
    unreached = [t for t, r in check.tiers.items() if r["verdict"] == "not_exercised" and r["present"]]
    if unreached:
        detail = (
            f"{_MEANING['cache_tier_not_exercised']} ({', '.join(unreached)}: no request was served "
            f"there; {_reachable(check, unreached)})"
        )
        return ProbeResult(Verdict.ERROR, "cache_tier_not_exercised", detail, evidence, measurements)
    judged = [t for t, r in check.tiers.items() if r["verdict"] == "honoured" and t != UNATTRIBUTED]
    where = f" in every tier ({', '.join(judged)})" if judged else ""
    by = " by body and by header" if check.header is not None else ""
    detail = f"the same salt hit ({same} tokens) and a different one did not{where}{by}"
    return ProbeResult(Verdict.PASS, "cache_salt_honoured", detail, evidence, measurements)


def _reachable(check: SaltCheck, unreached: list[str]) -> str:
    """Say why ``unreached`` tiers were not judged."""
    busy = sum(not r["tiers_attributed"] for r in check.rows)
    if busy:
        return (
            f"{busy} of {len(check.rows)} requests' tiers could not be told apart: the engine's counters "
            "moved by more than the request's own hits (other traffic)"
        )
    if all(t in check.reach for t in unreached):
        return "pushing the prefix out of the tiers above did not bring it there"
    return "the tiers above it cannot be emptied within the run's budget, or how much they hold is not known"


def _evidence(check: SaltCheck, gains: tuple[int, int] | None) -> dict[str, Any]:
    return {
        "tenant": check.tenant,
        "same_salt_gain_tokens": gains[0] if gains is not None else None,
        "other_salt_gain_tokens": gains[1] if gains is not None else None,
        "salt_header": check.header,
        "tiers": check.tiers,
        "tier_reading": check.view.evidence() if check.view is not None else None,
        "findings": check.found,
        "requests": check.rows,
    }


_MEANING = {
    "cache_salt_ignored": "a different cache_salt still hit: the salt is dropped or ignored",
    "cache_salt_header_ignored": "a different header salt still hit: the header does not separate",
    "cache_salt_body_overrides_header": (
        "a body cache_salt took a request out of the domain its header named: a client can pick its "
        "cache domain, the header is no boundary"
    ),
    "cache_salt_same_missed": (
        "cannot judge: the same cache_salt did not hit, so a miss under another proves nothing"
    ),
    "cache_salt_header_unobservable": (
        "cannot judge the header: the same header salt did not hit, so a miss under another proves nothing"
    ),
    "cache_tier_not_exercised": "cannot judge every tier: a tier the node has was never reached",
}
