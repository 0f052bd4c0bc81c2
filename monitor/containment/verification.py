"""A suspicion verified at once, before anything moves traffic.

A ``suspected`` finding (a traffic check that compares customers' texts, ``probes/base.py``) pages,
but a customer quoting the Gettysburg Address another customer pasted looks the same to it as a
stale page served across tenants. So when one is recorded, the target's probes that can give proof
run now rather than at their next interval: the kinds that plant or read sealed markers, or send a
prompt just over a node's measured pool (``Probe.verifies_suspicion``). A real leak then shows a
certain finding within seconds, which opens its own incident and quarantines as any proof does;
a benign coincidence shows none, and the suspicion stays a page for a person to confirm or dismiss.

What the runs found is written in the suspected incident's timeline as a ``verification`` event
(born delivered: the proof, if any, pages by itself) and counted in
``kvcanary_suspicion_verifications_total{target,outcome}``. A target is verified at most once per
``COOLDOWN_SECONDS``, and never twice at once: a flood of suspected records costs one round of runs.
A kind whose runs all ended in an error (a node busy or restarting for a moment) is run once more
``RETRY_SECONDS`` later when nothing else proved the leak: its next scheduled run may be a day away,
and a suspicion left unverified for a day is a page nobody can act on. The kinds run one at a time
(:meth:`Verifier._run_kinds` says why), so a round costs the sum of its runs, a few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime

from prometheus_client import Counter
from sqlalchemy.orm import Session, sessionmaker

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.incidents import NOTE_CHARS
from kvcanary.monitor.recording.pending import PendingResult
from kvcanary.monitor.runs.runner import RunSummary
from kvcanary.monitor.storage.models import Incident, IncidentEvent
from kvcanary.probes import REGISTRY
from kvcanary.probes.base import Verdict

log = logging.getLogger("kvcanary.containment")

#: The least time between two verifications of one target: the runs are real requests.
COOLDOWN_SECONDS = 60.0
#: How long a verification waits before it runs again the kinds none of whose runs was judged.
RETRY_SECONDS = 15.0
#: What a verification can come to (the counter's ``outcome`` label and the event's reason).
OUTCOMES = ("leak_found", "mismatch_found", "none_found", "not_judged", "no_verifying_probe")

#: Runs one kind on a target now, whoever's turn it is (``ProbeRunner.run``).
RunKind = Callable[[str, str], Awaitable[list[RunSummary]]]


class Verifier:
    """Runs a target's proving kinds when a suspicion is recorded on it (module doc)."""

    def __init__(
        self,
        settings: Callable[[], Settings],
        run: RunKind,
        session_factory: sessionmaker[Session],
        counter: Counter,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.settings = settings
        self.run = run
        self.session_factory = session_factory
        self.counter = counter
        self.clock = clock
        self.pause = pause
        self._last: dict[str, float] = {}
        self._running: dict[str, asyncio.Task[str]] = {}

    def suspect(self, item: PendingResult, incident_id: int) -> asyncio.Task[str] | None:
        """Verify ``item``'s target now unless it is being verified or was within the cooldown;
        return the verification's task (its outcome), or None when none was started."""
        target = self.settings().target(item.target)
        if target is None or item.target in self._running:
            return None
        now = self.clock()
        if now - self._last.get(item.target, float("-inf")) < COOLDOWN_SECONDS:
            return None
        self._last[item.target] = now
        kinds = [kind for kind in target.probes if REGISTRY[kind].verifies_suspicion]
        task = asyncio.get_running_loop().create_task(self._verify(item.target, kinds, incident_id))
        self._running[item.target] = task
        task.add_done_callback(lambda _: self._running.pop(item.target, None))
        return task

    async def _verify(self, target: str, kinds: Sequence[str], incident_id: int) -> str:
        began = self.clock()
        log.warning("%s: suspected leak (incident %d): verifying by %s now", target, incident_id,
                    ", ".join(kinds) or "nothing (no kind that can prove a leak is configured)")  # fmt: skip
        summaries = await self._run_kinds(target, kinds)
        if again := _unjudged(summaries, kinds):
            log.warning("%s: verification of incident %d: %s not judged; again in %.0f s",
                        target, incident_id, ", ".join(again), RETRY_SECONDS)  # fmt: skip
            await self.pause(RETRY_SECONDS)
            summaries += await self._run_kinds(target, again)
        outcome = _outcome(summaries, bool(kinds))
        note = _note(summaries, self.clock() - began)
        self.counter.labels(target, outcome).inc()
        log.warning("%s: verification of incident %d: %s (%s)", target, incident_id, outcome, note)
        try:
            await asyncio.to_thread(self._note, incident_id, outcome, note)
        except Exception as exc:  # the database away: the runs' own results are recorded (or spooled)
            log.warning(
                "%s: verification not noted on incident %d (%s)", target, incident_id, type(exc).__name__
            )
        return outcome

    async def _run_kinds(self, target: str, kinds: Sequence[str]) -> list[RunSummary]:
        """Run ``kinds`` on ``target`` one at a time, in the target's order, until one proves a leak;
        a kind that raised gave no summary.

        Not side by side: each proving kind reads the node's free pages as if its own requests were
        the last there (``boundary`` primes the head of the free list with another tenant's markers
        just before its over-capacity prompt). Run together, one kind's freed pages were what
        another's stale read met, of the probing tenant's own: the over-capacity answer was a
        ``mismatch`` where the node in fact leaks. A proof ends the round: the kinds after it would
        only send more requests to a node already proven to leak.
        """
        summaries: list[RunSummary] = []
        for kind in kinds:
            try:
                summaries += await self.run(target, kind)
            except Exception as exc:  # a reload removed the kind meanwhile; the others still run
                log.warning("%s/%s: verification run not made (%s)", target, kind, type(exc).__name__)
                continue
            if any(s.result.verdict is Verdict.LEAK for s in summaries):
                break
        return summaries

    def _note(self, incident_id: int, outcome: str, note: str) -> None:
        """Write the ``verification`` event in the incident's timeline (delivered: it pages nobody)."""
        now = datetime.now(UTC)
        with self.session_factory() as session, session.begin():
            incident = session.get(Incident, incident_id)
            if incident is None:
                return
            session.add(
                IncidentEvent(
                    incident_id=incident_id, kind="verification", created_at=now,
                    old_state=incident.state, new_state=incident.state, old_severity=incident.severity,
                    new_severity=incident.severity, reason=outcome, note=note[:NOTE_CHARS],
                    processed_at=now,
                )
            )  # fmt: skip


def _outcome(summaries: Sequence[RunSummary], any_kind: bool) -> str:
    verdicts = {s.result.verdict for s in summaries}
    if not any_kind:
        return "no_verifying_probe"
    if Verdict.LEAK in verdicts:
        return "leak_found"
    if Verdict.MISMATCH in verdicts:
        return "mismatch_found"
    return "none_found" if Verdict.PASS in verdicts else "not_judged"


def _unjudged(summaries: Sequence[RunSummary], kinds: Sequence[str]) -> list[str]:
    """The kinds to run once more: none, where a run proved the leak; else those with no judged run."""
    if any(s.result.verdict.is_failure for s in summaries):
        return []
    judged = {s.kind for s in summaries if s.result.verdict is not Verdict.ERROR}
    return [kind for kind in kinds if kind not in judged]


def _note(summaries: Sequence[RunSummary], seconds: float) -> str:
    """``cross_tenant: pass; boundary@prefill-a: leak (foreign_marker) …, in 2.1 s``."""
    said = [
        f"{s.kind}{'@' + s.node if s.node else ''}: {s.result.verdict.value}"
        + (f" ({s.result.reason})" if s.result.verdict is not Verdict.PASS else "")
        for s in summaries
    ]
    return f"{'; '.join(said) or 'no run ended'}, in {seconds:.1f} s"
