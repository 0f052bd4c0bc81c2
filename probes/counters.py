"""Counters: judge the isolation counters every serving node exports, between two reads.

Targets what probes alone cannot see: a leak on one request in millions. A worker that verifies page
ownership counts each read it refused (a foreign page reached a request and was caught); an engine
with the disclosed defect counts each over-capacity request it swapped for a placeholder; a node
configured to zero freed pages must never hand out a dirty one. These counters see every request,
so an increase between two reads is a finding, whatever the canaries say.

Why the check is sound:

- The page is parsed with prometheus-client's parser (by the target client), never regexes, and
  each canonical counter is read under the names its engine really uses
  (:mod:`probes.engine_counters`, one table). A counter the engine does not expose is reported as
  such; a node exposing none of the judged ones is an ``error`` ("cannot judge"), never a pass.
- Increases are taken between this read and the previous one, series by series (one data-parallel
  engine restarting is not the node starting again), kept in the probe's state (stored by the
  runner with each result, so restarts and replicas continue the series). A series below its
  previous value restarted: its increase is the new value, as Prometheus's ``increase()`` takes
  it; a changed ``process_start_time_seconds`` restarts them all, even one already climbed back
  above its old value. A series missing from one page keeps its last value. On the first read of
  a node the increase is counted from zero: the counters then cover the node's whole life so
  far, which the evidence says.
- Verdicts: ownership violations increased → ``leak``; placeholder substitutions or corrupted
  requests increased → ``mismatch``; dirty page reuse increased on a node that must zero freed pages
  (its ``kvcanary_worker_info{zero_freed_pages="true"}``, or ``require_zeroed_pages: true``) →
  ``mismatch``; metrics unreachable or unparseable → ``error``. The evidence names the node, each
  series, and its values before and after.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from probes.base import Probe, ProbeContext, ProbeOptions, ProbeResult, Verdict
from probes.engine_counters import CANONICAL, Canonical, names_for
from probes.target import Node

#: Every process exporting Prometheus metrics from a client library says when it started: a change
#: is a restart, even when a counter already climbed back above its old value.
_STARTED = "process_start_time_seconds"
#: Worse first: the verdict of a run is the worst any counter earned.
_RANK = {Verdict.LEAK: 2, Verdict.MISMATCH: 1, Verdict.PASS: 0}


class CountersOptions(ProbeOptions):
    # None: believe the node's own statement (the reference worker's kvcanary_worker_info).
    require_zeroed_pages: bool | None = None


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
        zeroing = ctx.options.get("require_zeroed_pages")
        if zeroing is None:
            zeroing = _worker_says_zeroing(samples)
        return judge_counters(ctx.target.engine, node, samples, ctx.state, zeroing=bool(zeroing))


def judge_counters(
    engine: str, node: Node, samples: dict[str, float], previous: dict[str, Any], *, zeroing: bool
) -> ProbeResult:
    """Return the verdict on ``samples`` against the ``previous`` state; the new state rides on it."""
    names = names_for(engine)
    before: dict[str, float] = dict(previous.get("counters", {}))
    started = samples.get(_STARTED)
    # The process began again since the last read: every counter did too, whatever its value.
    restarted = started is not None and previous.get("started") not in (None, started)
    before_series = {} if restarted else dict(previous.get("series", {}))
    by_series = "series" in previous and not restarted
    now: dict[str, float] = {}
    kept: dict[str, float] = {}
    series, not_exposed, missing, findings = [], [], [], []
    for counter in CANONICAL:
        if not names[counter.name]:
            not_exposed.append(counter.name)
            continue
        present = [n for n in names[counter.name] if n in samples]
        if not present:
            missing.append(counter.name)
            continue
        current = {k: v for n in present for k, v in _series(samples, n).items()}
        value = sum(samples[n] for n in present)
        now[counter.name] = value
        if by_series:  # each series against its own last value: one of them restarting is not all
            increase = sum(_increase(before_series.get(k), v) for k, v in current.items())
        else:  # the first read, a restart, or a state written before series were kept
            increase = _increase(None if restarted else before.get(counter.name), value)
        # A series absent from this page keeps its last value: back later, it is not new.
        kept.update({k: v for k, v in before_series.items() if _of(k, present)}, **current)
        series.append(
            {"counter": counter.name, "series": present, "before": before.get(counter.name), "after": value,
             "increase": increase}
        )  # fmt: skip
        if increase > 0 and _judged(counter, zeroing):
            findings.append((counter, increase))
    state = {"counters": now, "series": kept, "started": started, "read_at": datetime.now(UTC).isoformat()}
    evidence = {
        "node": node.name,
        "role": node.role,
        "engine": engine,
        "first_read": not before,
        "restarted": restarted,
        "series": series,
        "not_exposed": not_exposed,
        "missing": missing,
        "zeroing_required": zeroing,
    }
    judged = [c for c in CANONICAL if c.verdict is not None and c.name in now]
    if not judged:
        detail = f"{engine} exposes none of the judged counters on {_where(node)} ({', '.join(not_exposed)})"
        return ProbeResult(Verdict.ERROR, "not_exposed", detail, evidence, {}, state)
    if not findings:
        detail = f"{len(judged)} isolation counter(s) unchanged on {_where(node)}"
        return ProbeResult(Verdict.PASS, "counters_clean", detail, evidence, {}, state)
    worst = max(findings, key=lambda f: _RANK[f[0].verdict or Verdict.PASS])[0]
    detail = "; ".join(f"{c.name} +{n:g} on {_where(node)}: {c.meaning}" for c, n in findings)
    reason = f"{worst.name}_increased"
    return ProbeResult(worst.verdict or Verdict.PASS, reason, detail, evidence, {}, state)


def _series(samples: dict[str, float], name: str) -> dict[str, float]:
    """Return each series of counter ``name`` by its ``name{labels}`` key (the plain name if unlabelled)."""
    prefix = name + "{"
    labelled = {k: v for k, v in samples.items() if k.startswith(prefix)}
    return labelled or {name: samples[name]}


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
