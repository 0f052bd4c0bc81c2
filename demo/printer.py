"""What the demo prints: each verdict change, the first incident on the defective target in full,
the page and the rule as they reach Alertmanager, and the closing line that goes with the exit code."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from kvcanary.monitor.runs.runner import RunSummary
from kvcanary.probes.base import Verdict


class DemoPrinter:
    """Prints each verdict change, then the first incident on the defective target in full."""

    def __init__(self, kinds: Iterable[str]) -> None:
        self.kinds = set(kinds)  # the healthy target is green when each of them last passed
        self.last: dict[tuple[str, str], str] = {}
        self.caught: RunSummary | None = None
        self.paged: float | None = None  # seconds from the first leaking response to the page
        self.ruled: float | None = None  # ...and to Prometheus's own rule firing on the monitor's metrics
        #: Leak or mismatch verdicts on the healthy target, at any time: a false alarm fails the demo
        #: even if later passes hide it from the last verdicts.
        self.false_alarms: list[str] = []

    def page_seen(self, alert: dict[str, Any]) -> None:
        """Print the page once, with how long it took from the leaking run's start."""
        if self.paged is not None or self.caught is None:
            return
        self.paged = time.time() - self.caught.started_at.timestamp()
        labels = alert.get("labels", {})
        print(f"=== PAGED: {labels.get('alertname')} ({labels.get('severity')}) on {labels.get('target')}/"
              f"{labels.get('probe')} is in Alertmanager, {self.paged:.1f}s after the leaking run began ===",
              flush=True)  # fmt: skip
        print(f"  summary   : {alert.get('annotations', {}).get('summary', '')}")
        print(f"  incident  : {alert.get('annotations', {}).get('incident_url', '')}\n", flush=True)

    def rule_seen(self, alert: dict[str, Any]) -> None:
        if self.caught is None:
            return
        self.ruled = time.time() - self.caught.started_at.timestamp()
        labels = alert.get("labels", {})
        print(
            f"=== Prometheus's rule {labels.get('alertname')} fired on the same leak "
            f"({labels.get('target')}/{labels.get('probe')}), {self.ruled:.1f}s after it ===\n",
            flush=True,
        )

    def __call__(self, summary: RunSummary) -> None:
        key = (summary.target, summary.kind)
        verdict = summary.result.verdict
        if self.last.get(key) != verdict.value:
            mark = {"pass": "ok  ", "error": "ERR ", "mismatch": "FAIL", "leak": "LEAK"}[verdict.value]
            line = f"  [{mark}] {summary.target:<9} {summary.kind:<12} {verdict.value:<8}"
            print(f"{line} {summary.result.reason}", flush=True)
        self.last[key] = verdict.value
        if summary.target == "healthy" and verdict in (Verdict.LEAK, Verdict.MISMATCH):
            self.false_alarms.append(f"{summary.kind} {verdict.value} ({summary.result.reason})")
        if self.caught is None and summary.target == "defective" and verdict is Verdict.LEAK:
            self.caught = summary
            self._show(summary)

    def healthy_green(self) -> bool:
        mine = {kind: v for (t, kind), v in self.last.items() if t == "healthy"}
        return mine.keys() == self.kinds and all(v == "pass" for v in mine.values())

    def closing(self, paged: bool | None) -> tuple[int, str]:
        """The demo's exit code and the line that says why, both decided from the whole run's end.
        ``paged``: whether the page reached Alertmanager; None where none runs (nothing to page)."""
        unmet = []
        if self.caught is None:
            unmet.append("the leak on 'defective' was not caught")
        elif paged is False:
            unmet.append("no page reached Alertmanager")
        if self.false_alarms:
            unmet.append(f"the healthy target was judged {'; '.join(self.false_alarms[:3])}")
        if not self.healthy_green():
            last = ", ".join(f"{k} {v}" for (t, k), v in sorted(self.last.items()) if t == "healthy")
            unmet.append(f"the healthy target's last verdicts were not all pass: {last or 'none yet'}")
        if unmet:
            return 1, "=== demo: exit 1: " + "; ".join(unmet) + " ==="
        caught = "the leak caught and paged" if paged else "the leak caught (no Alertmanager here: not paged)"
        return 0, f"=== demo: exit 0: {caught}; the healthy target green to the end ==="

    def _show(self, s: RunSummary) -> None:
        leaks: list[dict[str, Any]] = s.result.evidence.get("leaks", [])
        print("\n=== LEAK CAUGHT on target 'defective' ===", flush=True)
        print(f"  probe     : {s.kind}    verdict: {s.result.verdict.value}    reason: {s.result.reason}")
        if s.outcome and s.outcome.incident_id:
            print(f"  incident  : #{s.outcome.incident_id} ({s.outcome.severity}, {s.outcome.change})")
        print(f"  detail    : {s.result.detail}")
        for hit in leaks[:2]:
            print(f"  marker    : {hit['marker_id']} of {hit['owner_tenant']} read by {hit['reader_tenant']}")
            print(f"  excerpt   : {hit['excerpt']!r}")
        m = s.result.measurements
        if "prompt_tokens_sent" in m:
            print(
                f"  usage     : sent {m.get('prompt_tokens_sent'):.0f} prompt tokens, engine reported "
                f"{m.get('prompt_tokens_reported', float('nan')):.0f}"
            )
        print("", flush=True)
