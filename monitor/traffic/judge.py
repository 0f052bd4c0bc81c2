"""The traffic judge: each record to its deployment, through every check of the registry
(``checks/__init__.py``), into results, rows and counts.

A record belongs to the target whose ``base_url`` (or one of whose nodes' URLs) is the record's
``api_base`` (compared by the key of ``kvcanary/wire.py``: case, surrounding blanks, trailing
slashes and ``/v1`` ignored), or that lists it under ``gateway_api_bases``. Each
deployment's records are judged under its own lock, one batch at a time, against its one
fingerprint window (``overlap.py``), so a record is judged once and in the order it came.

What a batch found becomes results of each check's ``result_kind`` (``traffic_marker``,
``traffic_tokens``, ``traffic_capacity``, ``traffic_overlap``; per target and node) and source
``traffic``, recorded through the same port as the runner's (``monitor/recording/port.py``):
incidents, their events and paging need nothing new. The judge names no check: it runs the ones
it is given (the registry, unless a test gives others) and treats their findings alike. A flagged
check is recorded at once, with the flagged records named in its evidence (record ids and upstream
ids, callers, figures); a check that only passed is recorded at most once per
``traffic.pass_interval_seconds``, which is what lets its incident resolve.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.config.targets import TargetConfig
from kvcanary.monitor.metrics.registry import MonitorMetrics
from kvcanary.monitor.recording.pending import PendingResult, Source
from kvcanary.monitor.routing import api_base_key, routes_of
from kvcanary.monitor.storage.traffic_rows import MinuteCounts, MinuteKey
from kvcanary.monitor.traffic.checks import (
    NEAR_POOL,
    REGISTRY,
    CheckContext,
    Finding,
    TrafficCheck,
    prompt_estimate,
)
from kvcanary.monitor.traffic.distinctive import DistinctiveWindow
from kvcanary.monitor.traffic.facts import TargetFacts
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.monitor.traffic.overlap import OverlapWindow
from kvcanary.monitor.traffic.refusals import RefusalRows, refused_row
from kvcanary.probes.base import ProbeResult, Verdict
from kvcanary.probes.markers import MarkerBook

#: Flagged records named in one result's evidence (the rest are counted).
EVIDENCE_RECORDS = 20
#: Seconds of judging the event loop does at a stretch before its other work (``/healthz``, the
#: stream's pulls and partition leases, probes' timing): a slice ends with the record that passes
#: it, about 40 µs for a 1 KB exchange's record and 1 ms for one with every print a side allows.
#: Under the 5 ms a thread holding the GIL would keep it from the loop, without a thread's cost.
#: What waits is multiplied: a /healthz takes 15-18 turns of the loop, a refresh of the stream's
#: partition leases about 32, each turn a slice (at 50 ms a turn, a refresh took 1.7 s; 50 of the
#: largest records, what a turn judged before, took 50 to 190 ms).
SLICE_SECONDS = 0.002
Record = Callable[[PendingResult], Awaitable[Any]]
#: A record routed to its target: (node, record, whether it is the monitor's own tenant's).
Routed = tuple[str, TrafficRecord, bool]


def own_key_digests(keys: Mapping[Any, str | None]) -> frozenset[str]:
    """Return the SHA-256 digests of the monitor's tenants' keys: how a gateway names their traffic."""
    return frozenset(hashlib.sha256(key.encode()).hexdigest() for key in keys.values() if key)


@dataclass
class Deployment:
    """What one target's traffic keeps between batches."""

    window: OverlapWindow
    distinctive: DistinctiveWindow
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_pass: dict[tuple[str, str], float] = field(default_factory=dict)


@dataclass
class Judged:
    """What one batch came to: counts for the answer, rows and results to write."""

    accepted: int = 0
    unmatched: int = 0
    own: int = 0  # the monitor's own tenants' records: not judged, counted and kept for blast radii
    flagged: int = 0
    kept: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    minutes: dict[MinuteKey, MinuteCounts] = field(default_factory=dict)
    results: list[PendingResult] = field(default_factory=list)

    def answer(self) -> dict[str, int]:
        return {
            "accepted": self.accepted,
            "unmatched": self.unmatched,
            "own": self.own,
            "flagged": self.flagged,
        }


@dataclass(frozen=True)
class _Batch:
    """What every chunk of one batch is judged with: read once, so a reload meanwhile changes none."""

    target: TargetConfig
    cpt: float | None
    pools: Mapping[str, int | None]
    window: OverlapWindow
    gateway: str
    received: datetime
    expires: datetime
    min_run: int | None
    min_prompt_run: int
    distinctive: DistinctiveWindow
    reworded_min_tokens: int | None


@dataclass
class _Group:
    """One (node, check)'s findings within a batch."""

    passed: int = 0
    flagged: list[tuple[TrafficRecord, Finding]] = field(default_factory=list)


#: What a batch found: node -> check -> its findings.
_Groups = dict[str, defaultdict[TrafficCheck, _Group]]


class TrafficJudge:
    """Judges records; see the module doc. ``clients`` are the targets' clients (calibration and
    capacity); ``own_keys`` the SHA-256 digests of the monitor's own tenants' keys (their traffic,
    where probes go through a gateway, is the monitor's and is not judged); ``clock`` is monotonic
    seconds (the windows' ages, the pass intervals); ``checks`` what each record gets, in order."""

    def __init__(
        self,
        settings: Settings,
        clients: Mapping[str, Any],
        markers: MarkerBook,
        metrics: MonitorMetrics,
        own_keys: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
        checks: Sequence[TrafficCheck] = REGISTRY,
    ):
        self.checks = tuple(checks)
        self.markers = markers
        self.metrics = metrics
        self.own_keys = frozenset(own_keys)
        self.clock = clock
        self.facts = TargetFacts(clients, clock)
        self._deployments: dict[str, Deployment] = {}
        self._refusal_rows = RefusalRows()
        #: One slice of judging at a time in this process, whichever deployment's: the loop's other
        #: work waits for one slice between its turns, not for one of each batch being judged
        #: (``_in_slices``).
        self._turn = asyncio.Lock()
        self.take_up(settings)

    def take_up(self, settings: Settings, changed: Iterable[str] = ()) -> None:
        """Use (reloaded) settings: routes, thresholds. Windows of targets still configured stay,
        unless the window's own settings changed; what is known of a ``changed`` target goes."""
        window_changed = getattr(self, "settings", settings).traffic != settings.traffic
        self.settings = settings
        self.routes = routes_of(settings)
        names = {t.name for t in settings.targets} - set(changed)
        self._deployments = (
            {} if window_changed else {k: v for k, v in self._deployments.items() if k in names}
        )
        for name in changed:
            self.facts.forget(name)

    def _deployment(self, target: str) -> Deployment:
        found = self._deployments.get(target)
        if found is None:
            cfg = self.settings.traffic
            window = OverlapWindow(
                cfg.overlap_window_seconds, cfg.overlap_max_fingerprints, cfg.overlap_common_callers
            )
            distinctive = DistinctiveWindow(cfg.overlap_window_seconds, cfg.overlap_max_fingerprints)
            found = self._deployments[target] = Deployment(window, distinctive)
        return found

    def target_of(self, record: TrafficRecord) -> str | None:
        """Return the name of the target ``record`` belongs to, or None."""
        route = self.routes.get(api_base_key(record.api_base))
        return None if route is None else route[0]

    async def judge(
        self, records: list[TrafficRecord], gateway: str, received: datetime | None = None
    ) -> Judged:
        """Judge ``records``; return what to write and record (nothing written here)."""
        received = received or datetime.now(UTC)
        out = Judged()
        by_target: dict[str, list[Routed]] = defaultdict(list)
        for record in records:
            route = self.routes.get(api_base_key(record.api_base))
            own = bool(record.key_hash) and record.key_hash in self.own_keys
            out.own += own
            if route is None:
                out.unmatched += not own
            else:
                by_target[route[0]].append((route[1], record, own))
        if out.unmatched:
            self.metrics.traffic_unmatched.labels(gateway).inc(out.unmatched)
        for name, routed in by_target.items():
            target = self.settings.target(name)
            if target is not None:
                await self._judge_target(target, routed, gateway, received, out)
        return out

    async def _judge_target(
        self,
        target: TargetConfig,
        records: list[Routed],
        gateway: str,
        received: datetime,
        out: Judged,
    ) -> None:
        groups: _Groups = {}
        while True:
            cpt = await self.facts.chars_per_token(target.name)
            pools = {node: await self.facts.pool(target.name, node) for node in {r[0] for r in records}}
            deployment = self._deployment(target.name)
            async with deployment.lock:
                if self._deployments.get(target.name) is not deployment:
                    # A reload replaced the window while this batch waited: judged anew, as the
                    # target now is (its facts read again), or not at all if it is gone.
                    current = self.settings.target(target.name)
                    if current is None:
                        return
                    target = current
                    continue
                # One reading of the settings for the whole batch, however long it takes.
                batch = _Batch(
                    target, cpt, pools, deployment.window, gateway, received,
                    received + timedelta(days=self.settings.retention.failure_days),
                    self.settings.traffic.overlap_min_run, self.settings.traffic.overlap_min_prompt_run,
                    deployment.distinctive, self.settings.traffic.reworded_min_tokens,
                )  # fmt: skip
                await self._judge_in_slices(batch, records, out, groups)
                self._count_verdicts(target.name, groups)
                out.results += self._results(target, deployment, groups, gateway, received)
                return

    async def _judge_in_slices(
        self, batch: _Batch, records: list[Routed], out: Judged, groups: _Groups
    ) -> None:
        """Judge ``records`` on the event loop, a slice at a time: a worker thread kept the GIL from
        the loop as long (the 5 ms switch interval), and its hand-offs cost the judge about a fifth
        of its CPU (bench/traffic.py). What a deployment idle for its window still holds expires
        first, in slices too."""
        now = self.clock()
        window, distinctive = batch.window, batch.distinctive
        await self._in_slices(lambda until: window.expire(now, until) & distinctive.expire(now, until))
        judged = 0

        def judge_slice(until: float) -> bool:
            nonlocal judged
            judged = self._judge_records(batch, records, judged, until, out, groups)
            return judged == len(records)

        await self._in_slices(judge_slice)

    async def _in_slices(self, step: Callable[[float], bool]) -> None:
        """Call ``step(until)`` until it returns True (done), each call to stop soon after the
        ``time.perf_counter()`` ``until`` (``SLICE_SECONDS`` on), one slice at a time in this process
        and the event loop's other work between them."""
        while True:
            async with self._turn:
                done = step(time.perf_counter() + SLICE_SECONDS)
                # Probes' timing, pulls, leases and health before the next slice, of any batch's:
                # the turn is held until then (given up between synchronous slices, nobody would
                # ever wait for it, and each batch being judged would take a slice a loop's turn).
                await asyncio.sleep(0)
            if done:
                return

    def _judge_records(
        self, batch: _Batch, records: list[Routed], start: int, until: float, out: Judged, groups: _Groups
    ) -> int:
        """Judge ``records`` from ``start`` on until the ``time.perf_counter()`` ``until`` passes (one
        record at least): findings into ``groups`` (node -> check), counts and kept rows into
        ``out``; return the index of the first record not judged."""
        target = batch.target.name
        context = CheckContext(
            target, self.markers, batch.cpt, batch.window, self.clock(), batch.min_run, batch.min_prompt_run,
            batch.distinctive, batch.reworded_min_tokens,
        )  # fmt: skip
        for at in range(start, len(records)):  # every record's: a look-up of its node's groups, one a check
            if at > start and time.perf_counter() >= until:
                return at
            node, record, own = records[at]
            pool = batch.pools[node]
            estimate = prompt_estimate(record, batch.cpt)
            if record.refused is not None:
                self._refused(batch, node, record, own, estimate, pool, out)
                continue
            flagged: list[Finding] = []
            if not own:  # the monitor's own request: not judged, but counted and kept as a customer's is
                found = groups.get(node) or groups.setdefault(node, defaultdict(_Group))
                context.node, context.pool, context.estimate = node, pool, estimate
                context.leaked = False
                for check in self.checks:
                    finding = check.judge(record, context)
                    if finding is None:
                        continue
                    group = found[check]
                    if finding.verdict is Verdict.PASS:
                        group.passed += 1
                    else:
                        group.flagged.append((record, finding))
                        flagged.append(finding)
                        context.leaked |= finding.verdict is Verdict.LEAK
            near = estimate is not None and pool is not None and estimate >= NEAR_POOL * pool
            self._count(out, target, node, record, bool(flagged), near, own)
            if flagged or near:
                row = _row(record, node, batch.gateway, batch.received, flagged, estimate, pool)
                out.kept.append((target, {**row, "own": own, "expires_at": batch.expires}))
        return len(records)

    def _refused(
        self,
        batch: _Batch,
        node: str,
        record: TrafficRecord,
        own: bool,
        estimate: float | None,
        pool: int | None,
        out: Judged,
    ) -> None:
        """Count a request the gateway refused, and keep it where ``refusals.py`` says: no check
        judges it, nor do its prints join a window."""
        target = batch.target.name
        assert record.refused is not None
        self.metrics.traffic_refused.labels(target, record.refused.by).inc()
        self._count(out, target, node, record, False, False, own, answered=False)
        if self._refusal_rows.keep(target, record):
            row = refused_row(_row(record, node, batch.gateway, batch.received, [], estimate, pool), record)
            out.kept.append((target, {**row, "own": own, "expires_at": batch.expires}))

    def _count_verdicts(self, target: str, groups: _Groups) -> None:
        verdicts: Counter[tuple[str, str]] = Counter()
        for found in groups.values():
            for check, group in found.items():
                verdicts[(check.name, Verdict.PASS.value)] += group.passed
                verdicts.update((check.name, f.verdict.value) for _, f in group.flagged)
        for (name, verdict), n in verdicts.items():
            if n:
                self.metrics.traffic_records.labels(target, name, verdict).inc(n)

    def _count(
        self, out: Judged, target: str, node: str, record: TrafficRecord, flagged: bool, near: bool,
        own: bool, answered: bool | None = None,
    ) -> None:  # fmt: skip
        out.accepted += not own
        out.flagged += flagged
        key = (target, node, record.caller, _minute(int(record.time // 60)))
        counts = out.minutes.get(key)
        if counts is None:
            counts = out.minutes[key] = MinuteCounts()
        ok = record.ok if answered is None else answered
        counts.add(
            answered=ok, flagged=flagged, near_pool=near, prompt_chars=record.prompt.chars, own=own and ok,
        )  # fmt: skip

    def _results(
        self, target: TargetConfig, deployment: Deployment, groups: _Groups, gateway: str, received: datetime
    ) -> list[PendingResult]:
        """Return a result per (node, check) that flagged a record, or that passed and is due its
        pass (at most one per ``pass_interval_seconds``), in the order of node, then check name."""
        now = self.clock()
        due = self.settings.traffic.pass_interval_seconds
        found = [(node, check, group) for node, by in groups.items() for check, group in by.items()]
        out = []
        for node, check, group in sorted(found, key=lambda each: (each[0], each[1].name)):
            if group.flagged:
                result = _flagged_result(check, group, gateway)
            elif now - deployment.last_pass.get((node, check.name), float("-inf")) >= due:
                detail = f"{group.passed} gateway records passed the {check.name} check"
                result = ProbeResult(
                    Verdict.PASS, "traffic_clean", detail, measurements={"records": float(group.passed)}
                )
            else:
                continue
            deployment.last_pass[(node, check.name)] = now
            out.append(
                PendingResult.of(
                    target, check.result_kind, result, received, 0.0, node=node, source=Source.TRAFFIC
                )
            )
        return out


@functools.lru_cache(maxsize=1024)
def _minute(index: int) -> datetime:
    """The start of minute ``index`` since the epoch, as the per-minute counts key it."""
    return datetime.fromtimestamp(index * 60, UTC)


def _flagged_result(check: TrafficCheck, group: _Group, gateway: str) -> ProbeResult:
    worst = Verdict.LEAK if any(f.verdict is Verdict.LEAK for _, f in group.flagged) else Verdict.MISMATCH
    first_record, first = group.flagged[0]
    named = [
        {"request_id": r.id, "upstream_id": r.upstream, "caller": r.caller, "reason": f.reason, **f.figures}
        for r, f in group.flagged[:EVIDENCE_RECORDS]
    ]
    callers = sorted({r.caller for r, _ in group.flagged})
    detail = (
        f"{len(group.flagged)} gateway record(s) of {len(callers)} caller(s) failed the {check.name} check "
        f"({first.reason}); first: request {first_record.upstream or first_record.id} of "
        f"{first_record.caller or 'an unnamed caller'}"
    )
    evidence = {"gateway": gateway, "flagged": len(group.flagged), "passed": group.passed, "records": named}
    measurements = {"records": float(len(group.flagged) + group.passed), "flagged": float(len(group.flagged))}
    return ProbeResult(worst, first.reason, detail, evidence, measurements, certainty=check.certainty)


def _row(
    record: TrafficRecord,
    node: str,
    gateway: str,
    received: datetime,
    flagged: list[Finding],
    estimate: float | None,
    pool: int | None,
) -> dict[str, Any]:
    """Return the ``traffic_record`` columns of one kept record (no text, no fingerprint); each
    finding's evidence rides in it over its figures (the marker check's markers, named)."""
    worst = Verdict.LEAK if any(f.verdict is Verdict.LEAK for f in flagged) else Verdict.MISMATCH
    findings: dict[str, Any] = {
        f.check: {"verdict": f.verdict.value, "reason": f.reason, **f.figures, **f.evidence} for f in flagged
    }
    return {
        "node": node, "gateway": gateway, "request_id": record.id, "upstream_id": record.upstream,
        "caller": record.caller,
        "caller_kind": record.caller_kind, "key_hash": record.key_hash,
        "model": record.model_group or record.model,
        "started_at": datetime.fromtimestamp(record.time, UTC), "received_at": received,
        "status_code": record.status, "stream": record.stream, "finish_reason": record.finish_reason,
        "latency_seconds": record.latency_seconds, "ttft_seconds": record.ttft_seconds,
        "prompt_chars": record.prompt.chars, "prompt_bytes": record.prompt.bytes,
        "prompt_messages": record.prompt.messages, "prompt_tokens": record.usage.prompt_tokens,
        "completion_tokens": record.usage.completion_tokens, "cached_tokens": record.usage.cached_tokens,
        # Rounded up, so that "over the pool" reads the same from the row as the check judged it.
        "estimated_prompt_tokens": None if estimate is None else math.ceil(estimate), "kv_pool_tokens": pool,
        "verdict": worst.value if flagged else Verdict.PASS.value,
        "checks": "," + ",".join(f.check for f in flagged) + "," if flagged else "",
        "findings": findings,
    }  # fmt: skip
