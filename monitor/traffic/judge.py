"""The traffic judge: each record to its deployment, through the four checks, into results,
rows and counts.

A record belongs to the target whose ``base_url`` (or one of whose nodes' URLs) is the record's
``api_base`` without a trailing ``/v1``, or that lists it under ``gateway_api_bases``. Each
deployment's records are judged under its own lock, one batch at a time, against its one
fingerprint window (``overlap.py``), so a record is judged once and in the order it came.

What a batch found becomes results of kinds ``traffic_marker``, ``traffic_tokens``,
``traffic_capacity`` and ``traffic_overlap`` (per target and node), recorded through the same
port as the runner's (``monitor/recording/port.py``): incidents, their events and paging need
nothing new. A flagged check is recorded at once, with the flagged records named in its evidence
(ids, callers, figures); a check that only passed is recorded at most once per
``traffic.pass_interval_seconds``, which is what lets its incident resolve.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from monitor.config.settings import Settings
from monitor.config.targets import TargetConfig
from monitor.metrics.registry import MonitorMetrics
from monitor.recording.pending import PendingResult
from monitor.storage.traffic_rows import MinuteCounts, MinuteKey
from monitor.targets.calibration import RECOUNT_SECONDS, SAMPLE_TEXT
from monitor.traffic import checks
from monitor.traffic.overlap import OverlapWindow
from monitor.traffic.schema import TrafficBatch, TrafficRecord
from probes.base import ProbeResult, Verdict
from probes.markers import MarkerBook

#: Flagged records named in one result's evidence (the rest are counted).
EVIDENCE_RECORDS = 20
Record = Callable[[PendingResult], Awaitable[Any]]


def api_base_key(url: str) -> str:
    """Return the form routes compare: no trailing slash, no trailing ``/v1``, lower-case host."""
    url = url.strip().rstrip("/").removesuffix("/v1").rstrip("/")
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}{sep}{host.lower()}{slash}{path}"


def routes_of(settings: Settings) -> dict[str, tuple[str, str]]:
    """Return ``{api base: (target, node)}`` for every configured target, node and mapping."""
    routes: dict[str, tuple[str, str]] = {}
    for target in settings.targets:
        routes[api_base_key(target.base_url)] = (target.name, "")
        for node in target.node_list():
            if node.name:
                routes.setdefault(api_base_key(node.info_url), (target.name, node.name))
        for base in target.gateway_api_bases:
            routes[api_base_key(base)] = (target.name, "")
    return routes


@dataclass
class Deployment:
    """What one target's traffic keeps between batches."""

    window: OverlapWindow
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_pass: dict[tuple[str, str], float] = field(default_factory=dict)


@dataclass
class Judged:
    """What one batch came to: counts for the answer, rows and results to write."""

    accepted: int = 0
    unmatched: int = 0
    flagged: int = 0
    kept: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    minutes: dict[MinuteKey, MinuteCounts] = field(default_factory=dict)
    results: list[PendingResult] = field(default_factory=list)

    def answer(self) -> dict[str, int]:
        return {"accepted": self.accepted, "unmatched": self.unmatched, "flagged": self.flagged}


@dataclass
class _Group:
    """One (node, check)'s findings within a batch."""

    passed: int = 0
    flagged: list[tuple[TrafficRecord, checks.Finding]] = field(default_factory=list)


class TrafficJudge:
    """Judges batches; see the module doc. ``clients`` are the targets' clients (calibration and
    capacity); ``clock`` is epoch seconds."""

    def __init__(
        self,
        settings: Settings,
        clients: Mapping[str, Any],
        markers: MarkerBook,
        metrics: MonitorMetrics,
        clock: Callable[[], float] = time.time,
    ):
        self.clients = clients
        self.markers = markers
        self.metrics = metrics
        self.clock = clock
        self._deployments: dict[str, Deployment] = {}
        self._counted: dict[str, float] = {}  # when the judge last counted SAMPLE_TEXT, by target
        self.take_up(settings)

    def take_up(self, settings: Settings) -> None:
        """Use (reloaded) settings: routes, thresholds; windows of targets still configured stay."""
        self.settings = settings
        self.routes = routes_of(settings)
        names = {t.name for t in settings.targets}
        self._deployments = {k: v for k, v in self._deployments.items() if k in names}

    def _deployment(self, target: str) -> Deployment:
        found = self._deployments.get(target)
        if found is None:
            cfg = self.settings.traffic
            window = OverlapWindow(
                cfg.overlap_window_seconds, cfg.overlap_max_fingerprints, cfg.overlap_common_callers
            )
            found = self._deployments[target] = Deployment(window)
        return found

    async def judge(self, batch: TrafficBatch, received: datetime | None = None) -> Judged:
        """Judge every record of ``batch``; return what to write and record (nothing written here)."""
        received = received or datetime.now(UTC)
        out = Judged()
        gateway = batch.gateway or "unnamed"
        if batch.dropped:
            self.metrics.traffic_dropped.labels(gateway).inc(batch.dropped)
        by_target: dict[str, list[tuple[str, TrafficRecord]]] = defaultdict(list)
        for record in batch.records:
            route = self.routes.get(api_base_key(record.api_base))
            if route is None:
                out.unmatched += 1
                continue
            by_target[route[0]].append((route[1], record))
        if out.unmatched:
            self.metrics.traffic_unmatched.labels(gateway).inc(out.unmatched)
        for name, records in by_target.items():
            target = self.settings.target(name)
            if target is not None:
                await self._judge_target(target, records, gateway, received, out)
        return out

    async def _judge_target(
        self,
        target: TargetConfig,
        records: list[tuple[str, TrafficRecord]],
        gateway: str,
        received: datetime,
        out: Judged,
    ) -> None:
        client = self.clients.get(target.name)
        cpt = await self._chars_per_token(target.name, client)
        pool = await self._pool(client)
        deployment = self._deployment(target.name)
        groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
        verdicts: Counter[tuple[str, str]] = Counter()
        async with deployment.lock:
            for node, record in records:
                findings, marker_evidence, estimate = self._check(target.name, record, cpt, pool, deployment)
                flagged = [f for f in findings if f.flagged]
                for finding in findings:
                    verdicts[(finding.check, finding.verdict)] += 1
                    group = groups[(node, finding.check)]
                    if finding.flagged:
                        group.flagged.append((record, finding))
                    else:
                        group.passed += 1
                near = estimate is not None and pool is not None and estimate >= checks.NEAR_POOL * pool
                self._count(out, target.name, node, record, bool(flagged), near)
                if flagged or near:
                    row = _row(record, node, gateway, received, flagged, marker_evidence, estimate, pool)
                    row["expires_at"] = received + timedelta(days=self.settings.retention.failure_days)
                    out.kept.append((target.name, row))
            out.results += self._results(target, deployment, groups, gateway, received)
        for (check, verdict), n in verdicts.items():
            self.metrics.traffic_records.labels(target.name, check, verdict).inc(n)

    def _check(
        self, target: str, record: TrafficRecord, cpt: float | None, pool: int | None, deployment: Deployment
    ) -> tuple[list[checks.Finding], list[dict[str, str]], float | None]:
        marker, evidence = checks.marker_check(record, self.markers, target)
        estimate = checks.prompt_estimate(record, cpt)
        found = [
            marker,
            checks.tokens_check(record, cpt),
            checks.capacity_check(record, estimate, pool),
            checks.overlap_check(
                record, deployment.window, self.clock(), self.settings.traffic.overlap_min_run
            ),
        ]
        return [f for f in found if f is not None], evidence, estimate

    async def _chars_per_token(self, name: str, client: Any) -> float | None:
        """Return the target's calibration; while it has none, count the monitor's own sample
        text with the target's tokenizer (at most once per ``RECOUNT_SECONDS``)."""
        calibration = getattr(client, "calibration", None)
        if calibration is None:
            return None
        if calibration.chars_per_token is None:
            now = time.monotonic()
            if now - self._counted.get(name, float("-inf")) >= RECOUNT_SECONDS:
                self._counted[name] = now
                await client.count_tokens(SAMPLE_TEXT)  # noted by the client's calibration
        return calibration.chars_per_token  # type: ignore[no-any-return]

    @staticmethod
    async def _pool(client: Any) -> int | None:
        """Return the node's smallest KV pool as the capacity audit last read it (10 minutes' reuse)."""
        if client is None or not hasattr(client, "capacity"):
            return None
        reading = await client.capacity(max_age=600)
        sizes = [n for n in (reading.kv_pool_tokens, *reading.pools.values()) if n]
        return min(sizes) if sizes else None

    def _count(
        self, out: Judged, target: str, node: str, record: TrafficRecord, flagged: bool, near: bool
    ) -> None:
        out.accepted += 1
        out.flagged += flagged
        minute = datetime.fromtimestamp(record.time - record.time % 60, UTC)
        counts = out.minutes.setdefault((target, node, record.caller, minute), MinuteCounts())
        counts.add(answered=record.ok, flagged=flagged, near_pool=near, prompt_chars=record.prompt.chars)

    def _results(
        self,
        target: TargetConfig,
        deployment: Deployment,
        groups: Mapping[tuple[str, str], _Group],
        gateway: str,
        received: datetime,
    ) -> list[PendingResult]:
        now = self.clock()
        due = self.settings.traffic.pass_interval_seconds
        out = []
        for (node, check), group in sorted(groups.items()):
            if group.flagged:
                result = _flagged_result(check, group, gateway)
            elif now - deployment.last_pass.get((node, check), float("-inf")) >= due:
                result = ProbeResult(
                    Verdict.PASS, "traffic_clean", f"{group.passed} gateway records passed the {check} check",
                    measurements={"records": float(group.passed)},
                )  # fmt: skip
            else:
                continue
            deployment.last_pass[(node, check)] = now
            out.append(PendingResult.of(target, f"traffic_{check}", result, received, 0.0, node=node))
        return out


def _flagged_result(check: str, group: _Group, gateway: str) -> ProbeResult:
    worst = Verdict.LEAK if any(f.verdict == "leak" for _, f in group.flagged) else Verdict.MISMATCH
    first_record, first = group.flagged[0]
    named = [
        {"request_id": r.id, "caller": r.caller, "reason": f.reason, **f.figures}
        for r, f in group.flagged[:EVIDENCE_RECORDS]
    ]
    callers = sorted({r.caller for r, _ in group.flagged})
    detail = (
        f"{len(group.flagged)} gateway record(s) of {len(callers)} caller(s) failed the {check} check "
        f"({first.reason}); first: request {first_record.id} of {first_record.caller or 'an unnamed caller'}"
    )
    evidence = {"gateway": gateway, "flagged": len(group.flagged), "passed": group.passed, "records": named}
    measurements = {"records": float(len(group.flagged) + group.passed), "flagged": float(len(group.flagged))}
    return ProbeResult(worst, first.reason, detail, evidence, measurements)


def _row(
    record: TrafficRecord,
    node: str,
    gateway: str,
    received: datetime,
    flagged: list[checks.Finding],
    marker_evidence: list[dict[str, str]],
    estimate: float | None,
    pool: int | None,
) -> dict[str, Any]:
    """Return the ``traffic_record`` columns of one kept record (no text, no fingerprint)."""
    verdict = "leak" if any(f.verdict == "leak" for f in flagged) else ("mismatch" if flagged else "pass")
    findings: dict[str, Any] = {
        f.check: {"verdict": f.verdict, "reason": f.reason, **f.figures} for f in flagged
    }
    if marker_evidence and "marker" in findings:
        findings["marker"]["markers"] = marker_evidence
    return {
        "node": node, "gateway": gateway, "request_id": record.id, "caller": record.caller,
        "caller_kind": record.caller_kind, "key_hash": record.key_hash,
        "model": record.model_group or record.model,
        "started_at": datetime.fromtimestamp(record.time, UTC), "received_at": received,
        "status_code": record.status, "stream": record.stream, "finish_reason": record.finish_reason,
        "latency_seconds": record.latency_seconds, "ttft_seconds": record.ttft_seconds,
        "prompt_chars": record.prompt.chars, "prompt_bytes": record.prompt.bytes,
        "prompt_messages": record.prompt.messages, "prompt_tokens": record.usage.prompt_tokens,
        "completion_tokens": record.usage.completion_tokens, "cached_tokens": record.usage.cached_tokens,
        "estimated_prompt_tokens": None if estimate is None else round(estimate), "kv_pool_tokens": pool,
        "verdict": verdict, "checks": "," + ",".join(f.check for f in flagged) + "," if flagged else "",
        "findings": findings,
    }  # fmt: skip
