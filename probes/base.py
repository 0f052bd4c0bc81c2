"""The probe interface: what a probe gets and what it returns.

A probe is one kind of check (``canary``, ``cross_tenant``, ``boundary``). It talks to a serving
endpoint only through ``probes/target.py``'s ``TargetClient``, which ``monitor/targets`` implements
over HTTP, and it returns a :class:`ProbeResult`. It never raises, never writes to a database,
metrics or alerts: the runner records (see ``docs/architecture.md``).

Verdicts:

- ``pass``: the output was judged and was right.
- ``leak``: another tenant's live marker came back in a response. Sound by construction: a
  marker is sealed with a 64-bit MAC under the monitor's key, so no model, nondeterministic or not,
  produces one by chance (2**-64).
- ``mismatch``: a wrong answer, or a success where a refusal was due.
- ``error``: the probe could not judge (refused connection, timeout, 5xx, bad credentials).
  An error never counts as a leak or a mismatch.

How a failure is known (its ``certainty``): ``certain`` where the evidence cannot arise by chance
(a live sealed marker in an answer, a 2xx for a prompt the node's measured pool cannot hold, the
engine's own integrity counters), ``suspected`` where a benign cause could produce it too. Probes
control both ends of what they judge, so their findings are certain; the traffic checks that
compare customers' texts (``monitor/traffic/checks/``) are the suspected ones.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from kvcanary.probes.markers import LeakHit, MarkerBook, redact_markers
from kvcanary.probes.target import Completion, CompletionRequest, Node, TargetClient


class Verdict(enum.StrEnum):
    PASS = "pass"
    LEAK = "leak"
    MISMATCH = "mismatch"
    ERROR = "error"

    @property
    def is_failure(self) -> bool:
        """Return True for the verdicts that open incidents (leak, mismatch)."""
        return self in (Verdict.LEAK, Verdict.MISMATCH)


#: How a failure is known (module doc). Containment acts on ``certain`` findings (and on suspected
#: ones an operator confirmed); a suspected one pages and is verified by the kinds that can prove it.
Certainty = Literal["certain", "suspected"]
CERTAINTIES: tuple[str, ...] = ("certain", "suspected")

#: Longest excerpt of model output a result may carry: evidence, not a second copy of the data.
EXCERPT_CHARS = 160
#: An engine that reports fewer prompt tokens than this share of what it was sent dropped the prompt.
MIN_REPORTED_SHARE = 0.5
#: No tokenizer packs more UTF-8 bytes than this into one token of the probes' plain text (English
#: BPE tokens run 3-5 bytes, the longest a few dozen): a floor when the engine cannot count for us.
MAX_BYTES_PER_TOKEN = 32


def prompt_tokens_dropped(sent: int | None, reported: int | None, prompt_bytes: int = 0) -> bool:
    """Return True when ``reported`` prompt tokens are implausibly few (None reported: cannot say).

    With ``sent`` (the engine's own count of the prompt) a report under half of it is dropped: a chat
    template only adds tokens. Without it, the floor is ``prompt_bytes / MAX_BYTES_PER_TOKEN``, and
    at least the incident's own signature: one token reported for a whole prompt.
    """
    if reported is None:
        return False
    if sent:
        return reported < MIN_REPORTED_SHARE * sent
    return reported < max(2, prompt_bytes // MAX_BYTES_PER_TOKEN)


@dataclass
class ProbeResult:
    """What one probe run concluded.

    ``reason`` is a short, bounded token (``nonce_missing``, ``foreign_marker``, ``accepted_over_capacity``)
    fit for a metric label; ``detail`` is one human sentence. ``evidence`` holds only redacted facts:
    marker ids, hashes, counts and excerpts already passed through :func:`redact_markers`.
    ``measurements`` holds numbers (``latency_seconds``, ``ttft_seconds``, ``status_code``,
    ``prompt_tokens_sent``, ``prompt_tokens_reported``).
    """

    verdict: Verdict
    reason: str
    detail: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    measurements: dict[str, float] = field(default_factory=dict)
    #: What the probe carries to its next run on this (target, node), e.g. counter readings; None
    #: keeps the previous state. The runner stores it with the result; the probe never writes.
    state: dict[str, Any] | None = None
    #: How a ``leak`` or ``mismatch`` is known (module doc); meaningless for a pass or an error.
    certainty: Certainty = "certain"

    @classmethod
    def error(cls, reason: str, detail: str = "", **measurements: float) -> ProbeResult:
        return cls(Verdict.ERROR, reason, detail, measurements=dict(measurements))


class ProbeContext:
    """Everything one probe run may use: the target, the marker book, and a scanning ``complete``.

    Every response a probe receives through :meth:`complete` is scanned against the live markers
    of the *other* tenants; hits accumulate in :attr:`leaks`, and :func:`judge` turns any hit
    into a ``leak`` verdict whatever the probe itself concluded.
    """

    def __init__(
        self,
        target: TargetClient,
        markers: MarkerBook,
        options: dict[str, Any] | None = None,
        *,
        node: Node | None = None,
        state: dict[str, Any] | None = None,
    ):
        self.target = target
        self.markers = markers
        self.options = options or {}
        #: The node a node-scoped probe judges (``Probe.scope == "node"``); None for the others.
        self.node = node
        #: What this probe left for itself at its previous run on this (target, node); {} at first.
        self.state: dict[str, Any] = dict(state or {})
        self.leaks: list[LeakHit] = []
        #: Answers whose usage reported far fewer prompt tokens than were sent (the incident's tell).
        self.dropped_prompts: list[dict[str, Any]] = []
        #: Tokens spent, as the engine reported them: the cost of monitoring.
        self.tokens = {"prompt": 0, "completion": 0}
        #: When (the event loop's clock) the runner cuts this run as a ``probe_timeout``; None where
        #: nothing cuts it. A probe that waits on the engine by choice stops its wait before this.
        self.deadline: float | None = None

    @property
    def tenants(self) -> list[str]:
        return self.target.tenants

    async def complete(
        self, tenant: str, request: CompletionRequest, *, sent_tokens: int | None = None
    ) -> Completion:
        """Send ``request`` as ``tenant``; scan the answer for foreign markers and check its usage.

        ``sent_tokens`` is the engine's own count of the prompt when the probe has it; without it the
        token-count invariant uses a floor from the prompt's length (:func:`prompt_tokens_dropped`).
        """
        completion = await self.target.complete(tenant, request)
        self.leaks.extend(self.markers.scan(completion.text, target=self.target.name, reader=tenant))
        self.tokens["prompt"] += completion.prompt_tokens or 0
        self.tokens["completion"] += completion.completion_tokens or 0
        size = len(request.prompt.encode()) + len((request.system or "").encode())
        if prompt_tokens_dropped(sent_tokens, completion.prompt_tokens, size):
            self.dropped_prompts.append(
                {"tenant": tenant, "prompt_bytes": size, "prompt_tokens_sent": sent_tokens,
                 "prompt_tokens_reported": completion.prompt_tokens, "status_code": completion.status}
            )  # fmt: skip
        return completion


class ProbeOptions(BaseModel):
    """A kind's ``options`` in targets.yml. Unknown keys are refused, so a typo exits 2 at startup
    instead of being silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Probe(ABC):
    """One probe kind. Subclasses set ``kind`` (the registry key, file name and metric label) and,
    when they take options, ``options_model``."""

    kind: ClassVar[str]
    options_model: ClassVar[type[ProbeOptions]] = ProbeOptions
    #: Seconds between runs when the target states none for this kind: None follows the target's
    #: interval; costly kinds set their own (never shorter than the target's).
    default_interval_seconds: ClassVar[float | None] = None
    #: A run's budget, in request timeouts of its target: most kinds send a few requests one after
    #: another; a timing audit sends hundreds.
    budget_timeouts: ClassVar[float] = 4.0
    #: ``target``: one run judges the serving path; ``node``: the runner runs the probe once per
    #: node (``ctx.node``), and each node's result and incident stand alone.
    scope: ClassVar[str] = "target"
    #: Tenants a target must name for the kind to run (judging what crosses tenants takes two).
    min_tenants: ClassVar[int] = 1
    #: Run at once when a node's configuration changes (the capacity audit saw its fingerprint move).
    reaudit_on_config_change: ClassVar[bool] = False
    #: Run at once when a suspected finding (a traffic check's) is recorded on the target: the kind
    #: plants or reads sealed markers, or the node's pool, so a real leak shows certain evidence
    #: within seconds and a benign coincidence shows none (``monitor/containment/verification.py``).
    verifies_suspicion: ClassVar[bool] = False
    #: Its findings are about a node's KV pool against the context window: a blast radius then
    #: starts at the node's first capacity reading below the window.
    judges_pool: ClassVar[bool] = False
    #: Its evidence depends on what the node does between two of its own requests (``boundary``
    #: primes the free list its over-capacity prompt's stale read meets): the runner runs it with no
    #: run of another kind on the target in between (``monitor/runs/turns.py``).
    runs_alone: ClassVar[bool] = False
    #: Its results carry the node's capacity figures, exported as the node's gauges.
    exports_node_capacity: ClassVar[bool] = False

    async def run(self, ctx: ProbeContext) -> ProbeResult:
        """Run :meth:`probe` and return its judged result; never raise (a crash is an ``error``)."""
        try:
            result = await self.probe(ctx)
        except Exception as exc:  # a probe bug must cost one verdict, never the monitor
            result = ProbeResult.error("probe_crashed", f"{type(exc).__name__}: {redact_markers(str(exc))}")
        return judge(result, ctx)

    @abstractmethod
    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        """Probe the target and return a verdict; :meth:`run` adds the leak judgement over every response."""


def unjudgeable(completion: Completion) -> str | None:
    """Return why ``completion`` says nothing about the output (a bounded reason), or None if it does.

    Judgeable: a complete 2xx answer, or a refusal the engine chose (see :attr:`Completion.refused`).
    Not judgeable: an answer the probe hung up on (``hung_up``), no answer (``unreachable``,
    ``timeout``), bad credentials (``auth_failed``), ``rate_limited``, ``server_error`` (5xx), a
    2xx whose body or stream broke (``protocol``, ``stream_error``, ``timeout``), an answer from
    something in front of the engine (``foreign_answer``), an engine's refusal that says nothing
    about the output (``refused``: 404 unknown model, 405), or any other status
    (``unexpected_status``).
    """
    kind = completion.error_kind
    if kind == "hung_up":
        return "hung_up"
    if completion.status is None:
        return "timeout" if kind == "timeout" else "unreachable"
    if completion.status in (401, 403):
        return "auth_failed"
    if completion.status == 429:
        return "rate_limited"
    if completion.status >= 500:
        return "server_error"
    if kind == "too_large":
        return "response_too_large"
    if completion.ok and kind is not None:
        return {"stream": "stream_error", "timeout": "timeout"}.get(kind, "protocol")
    if not completion.ok and not completion.refused:
        if kind == "foreign":
            return "foreign_answer"
        return "refused" if 400 <= completion.status < 500 else "unexpected_status"
    return None


def judge(result: ProbeResult, ctx: ProbeContext) -> ProbeResult:
    """Return the final result: any foreign marker seen in any response makes it a ``leak``; else an
    answer whose usage dropped the prompt makes a pass or an error a ``mismatch``.

    The evidence keeps marker ids, hashes and redacted excerpts only. Idempotent: a probe may judge
    its own result and the runner judge it again.
    """
    if not ctx.leaks:
        return _token_invariant(result, ctx)
    if result.verdict is Verdict.LEAK and "leak_count" in result.evidence:
        return result
    hits = ctx.leaks
    # A stale page is read whole, so one marker usually comes back several times: count markers.
    distinct = list({h.digest: h for h in hits}.values())
    owners = sorted({h.owner_tenant for h in hits})
    readers = sorted({h.reader_tenant for h in hits})
    evidence = dict(result.evidence)
    evidence["leaks"] = [h.as_evidence() for h in distinct[:8]]
    evidence["leak_count"] = len(distinct)
    evidence["leak_occurrences"] = len(hits)
    evidence["probe_verdict"] = result.verdict.value
    detail = (
        f"{len(distinct)} live marker(s) of tenant(s) {', '.join(owners)} came back "
        f"{len(hits)} time(s) in responses to {', '.join(readers)}"
    )
    if result.verdict is not Verdict.PASS and result.detail:
        detail += f"; the probe also found: {result.detail}"
    return ProbeResult(Verdict.LEAK, "foreign_marker", detail, evidence, result.measurements, result.state)


def _token_invariant(result: ProbeResult, ctx: ProbeContext) -> ProbeResult:
    """Turn a pass or an error into a ``mismatch`` when an engine reported a dropped prompt.

    Whatever the status code: the incident answered 200 with ``prompt_tokens = 1`` for a prompt of a
    million tokens. A probe's own mismatch or leak already says more and is kept.
    """
    if not ctx.dropped_prompts or result.verdict not in (Verdict.PASS, Verdict.ERROR):
        return result
    first = ctx.dropped_prompts[0]
    sent = first["prompt_tokens_sent"] or f"at least {max(2, first['prompt_bytes'] // MAX_BYTES_PER_TOKEN)}"
    detail = (
        f"the engine reported {first['prompt_tokens_reported']} prompt tokens for a prompt of {sent} tokens "
        f"({first['prompt_bytes']} bytes, HTTP {first['status_code']})"
    )
    evidence = {
        **result.evidence,
        "dropped_prompts": ctx.dropped_prompts[:8],
        "probe_verdict": result.verdict.value,
    }
    return ProbeResult(
        Verdict.MISMATCH, "prompt_tokens_mismatch", detail, evidence, result.measurements, result.state
    )


def excerpt(text: str, around: int | None = None) -> str:
    """Return at most EXCERPT_CHARS of ``text`` (centred on ``around``), markers redacted."""
    if around is None:
        around = 0
    start = max(0, around - EXCERPT_CHARS // 2)
    return redact_markers(text[start : start + EXCERPT_CHARS])
