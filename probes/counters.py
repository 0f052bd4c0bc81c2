"""Counters: judge the isolation counters every serving node exports, between two reads.

Targets what probes alone cannot see: a leak on one request in millions. A worker that verifies page
ownership counts each read it refused (a foreign page reached a request and was caught); an engine
with the disclosed defect counts each over-capacity request it swapped for a placeholder; a node
configured to zero freed pages must never hand out a dirty one. These counters see every request,
so an increase between two reads is a finding, whatever the canaries say.

Why the check is sound (each rule and its reason: ``docs/detection-research.md`` §4, "Counters"):

- each counter is read under the names its engine really uses (:mod:`probes.engine_counters`), from
  a page parsed by prometheus-client; a node exposing none of the judged ones is an ``error``;
- increases are taken series by series between reads kept in the probe's state, a series below its
  previous value (or a new ``process_start_time_seconds``) read as restarted, as ``increase()`` does;
- a counter is judged on what it gained within ``lookback_seconds``, so a fault that recurs every
  other read never reads as a recovery;
- ownership violations are a ``leak``; placeholder substitutions, corrupted requests, KV read after
  its release, dirty reuse where pages must be zeroed, and a balance short at two reads are a
  ``mismatch``; state gauges are listed, never judged;
- what an engine only logs (SGLang's KV canary) is read from ``log_metrics_url``; a log page that
  cannot be read leaves a clean engine page an ``error``.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime
from typing import Any

from pydantic import Field

from kvcanary.probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict
from kvcanary.probes.engine_counters import (
    CANONICAL,
    ENGINE_BALANCES,
    Balance,
    Canonical,
    balance_gaps,
    gauge_readings,
    names_for,
    sample_names,
    series_of,
)
from kvcanary.probes.target import Node

#: Every process exporting Prometheus metrics from a client library says when it started: a change
#: is a restart, even when a counter already climbed back above its old value.
_STARTED = "process_start_time_seconds"
#: Worse first: the verdict of a run is the worst any counter earned.
_RANK = {Verdict.LEAK: 2, Verdict.MISMATCH: 1, Verdict.PASS: 0}


class CountersOptions(ProbeOptions):
    # None: believe the node's own statement (the reference worker's kvcanary_worker_info).
    require_zeroed_pages: bool | None = None
    # How long a counter's increase keeps its finding: 0 judges each read alone.
    lookback_seconds: float = Field(900.0, ge=0, le=7 * 86400)


class CountersProbe(Probe):
    """Read each node's metrics and judge the increase of every isolation counter it exports."""

    kind = "counters"
    scope = "node"
    options_model = CountersOptions

    async def probe(self, ctx: ProbeContext) -> ProbeResult:
        node = ctx.node or ctx.target.nodes[0]
        scraped = await ctx.target.scrape(node.metrics_url)
        if scraped.samples is None:
            return ProbeResult.error(scraped.reason, scraped.error)
        samples = scraped.samples
        log_page = None if node.log_metrics_url is None else await ctx.target.scrape(node.log_metrics_url)
        if log_page is not None and log_page.samples is not None:
            samples = with_log_samples(ctx.target.engine, samples, log_page.samples)
        zeroing = ctx.options.get("require_zeroed_pages")
        if zeroing is None:
            zeroing = _worker_says_zeroing(samples)
        lookback = float(ctx.options.get("lookback_seconds", 900.0))
        result = judge_counters(
            ctx.target.engine, node, samples, ctx.state, zeroing=bool(zeroing), now=time.time(),
            lookback_seconds=lookback,
        )  # fmt: skip
        if log_page is None:
            return result
        result.evidence["log_metrics"] = {"url": node.log_metrics_url, "read": log_page.samples is not None}
        if log_page.samples is not None or result.verdict in (Verdict.LEAK, Verdict.MISMATCH):
            return result
        # Nothing found on the engine's page, but what its log says went unread: that is no pass.
        detail = f"{result.detail}; and its log's page could not be read ({log_page.error})"
        reason = f"log_{log_page.reason}"
        return dataclasses.replace(result, verdict=Verdict.ERROR, reason=reason, detail=detail)


def with_log_samples(
    engine: str, samples: dict[str, float], log_samples: dict[str, float]
) -> dict[str, float]:
    """Return the engine's ``samples`` with what its log exporter's page adds: the samples kvcanary
    reads for ``engine`` only (the exporter's own process start time is not the engine's), and never
    one the engine's page already has."""
    wanted = sample_names(engine)
    added = {k: v for k, v in log_samples.items() if k.split("{", 1)[0] in wanted and k not in samples}
    return {**samples, **added}


def judge_counters(
    engine: str,
    node: Node,
    samples: dict[str, float],
    previous: dict[str, Any],
    *,
    zeroing: bool,
    now: float | None = None,
    lookback_seconds: float = 0.0,
) -> ProbeResult:
    """Return the verdict on ``samples`` against the ``previous`` state; the new state rides on it.

    ``now`` is the read's time (seconds since the epoch; None: the clock's); a judged counter's
    increases within ``lookback_seconds`` before it, kept in the state, count with this read's."""
    now = time.time() if now is None else now
    started = samples.get(_STARTED)
    # The process began again since the last read: every counter did too, whatever its value.
    restarted = started is not None and previous.get("started") not in (None, started)
    reading = _read_counters(engine, samples, previous, restarted=restarted, zeroing=zeroing)
    # A restarted process (the fix deployed, as often as not) starts a lookback of its own: what the
    # process before it did is not held against it. Without a start time, a counter that went
    # down says its process began again (engines without process_start_time_seconds).
    forget = {c.name for c in CANONICAL} if restarted else reading.began_again
    recent = _recent(previous, reading.increases, now, lookback_seconds, forget)
    gaps = balance_gaps(engine, samples)
    prior = previous.get("balances")  # absent from states written before balances were kept
    short = _short_balances(engine, gaps, prior if isinstance(prior, dict) and not restarted else {})
    state = {
        "counters": reading.values, "series": reading.kept, "started": started,
        "read_at": datetime.fromtimestamp(now, UTC).isoformat(), "recent": recent,
        "balances": {name: figures["gap"] for name, figures in gaps.items()},
    }  # fmt: skip
    evidence = {
        "node": node.name,
        "role": node.role,
        "engine": engine,
        "first_read": reading.first_read,
        "restarted": restarted,
        "series": reading.series,
        "not_exposed": reading.not_exposed,
        "missing": reading.missing,
        "zeroing_required": zeroing,
        "lookback_seconds": lookback_seconds,
        "recent_increases": recent,
        "balances": gaps,
        "gauges": gauge_readings(engine, samples),
    }
    said = [(c.verdict or Verdict.PASS, f"{c.name}_increased",
             _finding(c, n, g, recent, lookback_seconds, node))
            for c, n, g in _lookback_findings(reading.increases, recent)]  # fmt: skip
    said += [(b.verdict, f"{b.name}_unbalanced", _unbalanced(b, gaps[b.name], n, node)) for b, n in short]
    return _verdict(said, engine, node, reading, evidence, state)


@dataclasses.dataclass
class _Reading:
    """What one read says of each counter against the previous read."""

    first_read: bool  # no counter was read before
    values: dict[str, float] = dataclasses.field(default_factory=dict)  # each counter's total now
    #: Each series' last value: one absent from this page keeps its old one (back later, it is not new).
    kept: dict[str, float] = dataclasses.field(default_factory=dict)
    series: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the evidence's rows
    not_exposed: list[str] = dataclasses.field(default_factory=list)  # no name on this engine
    missing: list[str] = dataclasses.field(default_factory=list)  # named, absent from the page
    increases: dict[str, float] = dataclasses.field(default_factory=dict)  # of the counters judged here
    #: Counters a series of which went down: its process restarted.
    began_again: set[str] = dataclasses.field(default_factory=set)


def _read_counters(
    engine: str, samples: dict[str, float], previous: dict[str, Any], *, restarted: bool, zeroing: bool
) -> _Reading:
    """Return each canonical counter's value and increase since the ``previous`` read."""
    names = names_for(engine)
    before: dict[str, float] = dict(previous.get("counters", {}))
    before_series = {} if restarted else dict(previous.get("series", {}))
    by_series = "series" in previous and not restarted
    reading = _Reading(first_read=not before)
    for counter in CANONICAL:
        if not names[counter.name]:
            reading.not_exposed.append(counter.name)
            continue
        present = [n for n in names[counter.name] if n in samples]
        if not present:
            reading.missing.append(counter.name)
            continue
        current = {k: v for n in present for k, v in series_of(samples, n).items()}
        value = sum(samples[n] for n in present)
        reading.values[counter.name] = value
        if by_series:  # each series against its own last value: one of them restarting is not all
            increase = sum(_increase(before_series.get(k), v) for k, v in current.items())
            if any(v < before_series.get(k, v) for k, v in current.items()):
                reading.began_again.add(counter.name)
        else:  # the first read, a restart, or a state written before series were kept
            increase = _increase(None if restarted else before.get(counter.name), value)
        reading.kept.update({k: v for k, v in before_series.items() if _of(k, present)}, **current)
        reading.series.append(
            {"counter": counter.name, "series": present, "before": before.get(counter.name), "after": value,
             "increase": increase}
        )  # fmt: skip
        if _judged(counter, zeroing):
            reading.increases[counter.name] = increase
    return reading


def _lookback_findings(
    increases: dict[str, float], recent: list[dict[str, Any]]
) -> list[tuple[Canonical, float, float]]:
    """Return each judged counter that gained within the lookback: (counter, this read's increase,
    the lookback's)."""
    findings = []
    for counter in CANONICAL:
        gained = sum(r["increases"].get(counter.name, 0) for r in recent)
        if counter.name in increases and gained > 0:
            findings.append((counter, increases[counter.name], gained))
    return findings


def _verdict(
    said: list[tuple[Verdict, str, str]],
    engine: str,
    node: Node,
    reading: _Reading,
    evidence: dict[str, Any],
    state: dict[str, Any],
) -> ProbeResult:
    """Return the worst of the findings ``said``; without one, a pass where a judged counter was
    read, else an error (``not_exposed``: nothing to judge is no pass)."""
    judged = [c for c in CANONICAL if c.verdict is not None and c.name in reading.values]
    if not said and not judged:
        exposed = ", ".join(reading.not_exposed)
        detail = f"{engine} exposes none of the judged counters on {_where(node)} ({exposed})"
        return ProbeResult(Verdict.ERROR, "not_exposed", detail, evidence, {}, state)
    if not said:
        detail = f"{len(judged)} isolation counter(s) unchanged on {_where(node)}"
        return ProbeResult(Verdict.PASS, "counters_clean", detail, evidence, {}, state)
    verdict, reason, _ = max(said, key=lambda f: _RANK[f[0]])
    return ProbeResult(verdict, reason, "; ".join(f[2] for f in said), evidence, {}, state)


def _short_balances(
    engine: str, gaps: dict[str, dict[str, float]], before: dict[str, Any]
) -> list[tuple[Balance, float]]:
    """Return the balances of ``engine`` short at this read and at the previous one, each with the
    previous read's gap: one short read alone may be a scrape between the engine's two increments."""
    short = []
    for balance in ENGINE_BALANCES.get(engine, ()):
        gap, earlier = gaps.get(balance.name, {}).get("gap", 0.0), before.get(balance.name)
        if gap > 0 and isinstance(earlier, int | float) and earlier > 0:
            short.append((balance, float(earlier)))
    return short


def _unbalanced(balance: Balance, figures: dict[str, float], before: float, node: Node) -> str:
    """Say by how much a balance fell short, now and at the previous read."""
    return (
        f"{balance.name} short on {_where(node)}: {balance.whole} {figures['whole']:g} against "
        f"{figures['parts']:g} by source ({figures['gap']:g} put down to none; {before:g} at the previous "
        f"read): {balance.meaning}"
    )


def _recent(
    previous: dict[str, Any], increases: dict[str, float], now: float, lookback: float, forget: set[str]
) -> list[dict[str, Any]]:
    """Return the reads within ``lookback`` of ``now`` that increased a judged counter, oldest
    first, this one last if it did: ``{"at": epoch seconds, "increases": {counter: n}}``; the
    increases of the counters in ``forget`` (their process began again) before this read left out."""
    kept = []
    for read in previous.get("recent", []):
        if _read_within(read, now, lookback):
            left = {name: n for name, n in read["increases"].items() if name not in forget}
            if left:
                kept.append({"at": read["at"], "increases": left})
    gained = {name: n for name, n in increases.items() if n > 0}
    if gained:
        kept.append({"at": now, "increases": gained})
    return kept[-64:]  # a bound: a counter climbing every read needs only the lookback's sum


def _read_within(read: Any, now: float, lookback: float) -> bool:
    """Whether ``read`` (a kept read, as the state stores it) is well formed and within the lookback."""
    if not isinstance(read, dict) or not isinstance(read.get("increases"), dict):
        return False
    at = read.get("at")
    return isinstance(at, int | float) and 0 <= now - at <= lookback


def _finding(
    counter: Canonical, read: float, gained: float, recent: list[dict[str, Any]], lookback: float, node: Node
) -> str:
    """Say what a counter gained: at this read, and within the lookback, read by read."""
    if read == gained:
        return f"{counter.name} +{read:g} on {_where(node)}: {counter.meaning}"
    times = ", ".join(
        f"+{r['increases'][counter.name]:g} at {datetime.fromtimestamp(r['at'], UTC):%H:%M:%S}"
        for r in recent if counter.name in r["increases"]
    )  # fmt: skip
    return (
        f"{counter.name} +{gained:g} in the last {lookback:g} s on {_where(node)} ({times} UTC; +{read:g} "
        f"since the previous read, so the finding holds): {counter.meaning}"
    )


def _of(key: str, names: list[str]) -> bool:
    return any(key == n or key.startswith(n + "{") for n in names)


def _judged(counter: Canonical, zeroing: bool) -> bool:
    return counter.verdict is not None and (zeroing or not counter.only_when_zeroing)


def _increase(before: float | None, after: float) -> float:
    """Return the increase since ``before``; a drop is a restart (the counter began again at 0)."""
    if before is None:
        return after
    return after - before if after >= before else after


def _worker_says_zeroing(samples: dict[str, float]) -> bool:
    return any(
        name.startswith("kvcanary_worker_info{") and 'zero_freed_pages="true"' in name and value == 1
        for name, value in samples.items()
    )


def _where(node: Node) -> str:
    return f"node {node.name}" if node.name else "the node"
