"""An incident's blast radius put together: the sources' counts, what was excluded and why, and
the disclosure summary in the shape of the incident's own.

The figures come from one source, the most trusted (``BlastSource.trust``: the gateway's logs,
every request with its id, then LiteLLM's spend log, then the traffic the monitor recorded, what
the tap delivered) among those that cover the window about as well as the best one. Every source's
own count is listed beside them, so a disagreement shows. Where no source covers the window the
counts are None: unknown, never zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvcanary.monitor.blast.question import Criterion, Scope, Window
from kvcanary.monitor.blast.source import CallerCount, Tally

OWN = "the monitor's own canary tenants (their key hash)"
LISTED = "listed by the operator"
#: A source whose records span this much of the window counts as covering it.
FULL = 0.9
#: Among the sources covering the window within this share of the best one, the most trusted counts.
SLACK = 0.1
#: Sources are compared at the coarsest time grain among them: the recorded traffic's minute
#: counts. Without it a log's exact first and last requests lose up to two minutes against the
#: same traffic counted by the minute, and the tap would outrank the logs of a short incident.
GRAIN_S = 60.0


@dataclass
class BlastRadius:
    incident: dict[str, Any]
    scope: Scope
    sources: list[Tally]
    deployment: dict[str, Any] = field(default_factory=dict)

    @property
    def exclude(self) -> tuple[str, ...]:
        return self.scope.exclude

    @property
    def window(self) -> Window:
        return self.scope.window

    @property
    def criterion(self) -> Criterion:
        return self.scope.criterion

    def coverage(self, tally: Tally) -> float:
        return tally.coverage(self.scope.start_epoch, self.scope.end_epoch)

    @functools.cached_property  # the sources are settled when the report is made
    def primary(self) -> Tally | None:
        """The source the figures come from: the most trusted among those that cover the window
        about as well as the best does (within ``SLACK``): logs rotated to their last hour do not
        outrank a tap that saw the whole window. Of sources trusted alike, the first listed."""
        covered = [t for t in self.sources if t.covered]
        if not covered:
            return None
        share = [t.coverage(self.scope.start_epoch, self.scope.end_epoch, GRAIN_S) for t in covered]
        near = [t for t, s in zip(covered, share, strict=True) if s >= max(share) - SLACK]
        return max(near, key=_trust)  # max keeps the first of equals

    def callers(self) -> list[tuple[str, CallerCount]]:
        found = self.primary
        if found is None:
            return []
        kept = [(c, n) for c, n in found.callers.items() if c not in self.exclude and n.responses]
        return sorted(kept, key=lambda item: (-item[1].responses, item[0]))

    def excluded(self) -> list[dict[str, Any]]:
        found = self.primary
        if found is None:
            return []
        out = [{"caller": c, "reason": OWN, "responses": n.responses} for c, n in sorted(found.own.items())]
        out += [
            {
                "caller": c,
                "reason": LISTED,
                "responses": found.callers[c].responses if c in found.callers else 0,
            }
            for c in self.exclude
        ]
        return out

    @property
    def responses(self) -> int | None:
        if self.criterion.kind == "none":
            return 0
        return None if self.primary is None else sum(n.responses for _, n in self.callers())

    def series(self) -> list[int]:
        counts = [0] * (self.scope.buckets + 1)
        found = self.primary
        if found is not None:
            for bucket, n in found.buckets.items():
                counts[min(max(bucket, 0), len(counts) - 1)] += n
        return counts

    def note(self) -> str:
        if self.criterion.kind == "none":
            return "An availability incident: no response was exposed by it."
        if self.primary is None:
            return (
                "No traffic source covers this window: the blast radius is unknown, not zero. "
                "Add the gateway tap, or give the gateway's logs (--logs) or its spend log (--litellm-db)."
            )
        share = self.coverage(self.primary)
        if share < FULL:
            return (
                f"The sources hold records of only {share:.0%} of the window ({self.primary.name} counted): "
                "requests outside what they hold are not in the counts."
            )
        return ""

    def as_json(self) -> dict[str, Any]:
        affected = self.responses if self.criterion.kind != "at_risk" else None
        at_risk = self.responses if self.criterion.kind == "at_risk" else None
        w, c = self.window, self.criterion
        return {
            "incident": self.incident,
            "window": {"start": w.start.at, "start_how": w.start.how, "end": w.end.at, "end_how": w.end.how},
            "criterion": {"kind": c.kind, "label": c.label, "rule": c.text, "pool_tokens": c.pool_tokens,
                          "check": c.check},
            "affected_responses": affected,
            "at_risk_responses": at_risk,
            "callers": [n.as_json(caller) for caller, n in self.callers()],
            "excluded": self.excluded(),
            "sources": [self._source_json(t) for t in self.sources],
            "series": {
                "start": w.start.at, "bucket_seconds": self.scope.bucket_seconds, "counts": self.series(),
            },
            "deployment": self.deployment,
            "disclosure": self.disclosure(),
            "note": self.note(),
        }  # fmt: skip

    def _source_json(self, t: Tally) -> dict[str, Any]:
        """One source's own answer; ``responses`` as the headline counts them (exclusions out)."""
        return {"name": t.name, "about": t.source.about if t.source is not None else None,
                "read": t.detail, "covered": t.covered, "primary": t is self.primary,
                "coverage": round(self.coverage(t), 3), "rows_read": t.rows_read,
                "responses": t.customer_responses(self.exclude) if t.covered else None,
                "own_responses": sum(n.responses for n in t.own.values()) if t.covered else None,
                "notes": t.notes}  # fmt: skip

    def disclosure(self) -> list[str]:
        """The summary an operator sends, sentence by sentence."""
        i, w, c = self.incident, self.window, self.criterion
        where = f"{i['target']}" + (f" (node {i['node']})" if i["node"] else "")
        n = self.responses
        lines = [
            f"Window: {_when(w.start.at)} to {_when(w.end.at)} ({_span(w.seconds)}); from {w.start.how}; "
            f"to {w.end.how}.",
            f"Condition: {i['title']}. {_deployment(self.deployment)}",
        ]
        if n is None:
            lines.append(f"Responses {c.label} on {where}: unknown (no traffic source covers the window).")
        else:
            callers = self.callers()
            named = ", ".join(f"{name or '(unnamed)'} {count.responses}" for name, count in callers[:8])
            lines.append(f"Responses {c.label} on {where}: {n} ({c.text}), of {len(callers)} caller(s)"
                         + (f": {named}." if named else "."))  # fmt: skip
        for item in self.excluded():
            lines.append(
                f"Excluded: {item['responses']} response(s) of {item['caller'] or '(unnamed)'}, "
                f"{item['reason']}."
            )
        paged = i.get("paged_at")
        lines.append(
            f"Detected {_when(i['opened_at'])} by {i['probe']}; "
            f"paged {_when(paged) if paged else 'not yet'}; "
            f"resolved {_when(i['resolved_at']) if i['resolved_at'] else 'not yet'}."
        )
        if self.primary is not None:  # the source's name only: paths and hosts stay behind the API token
            lines.append(f"Counted from {self.primary.name}.")
        return lines


def _trust(tally: Tally) -> int:
    """How far a tally's source is trusted; one counted outside a source list, least of all."""
    return tally.source.trust if tally.source is not None else 0


def _deployment(d: dict[str, Any]) -> str:
    if not d:
        return "No capacity reading of the node is kept from then."
    pools = d.get("pools") or {}
    parts = [f"{name} pool {size:,} tokens" for name, size in sorted(pools.items()) if isinstance(size, int)]
    if d.get("context_window"):
        parts.append(f"context window {d['context_window']:,}")
    if d.get("disaggregation_mode"):
        parts.append(f"disaggregation {d['disaggregation_mode']}")
    parts.append(f"engine version {d.get('version') or 'not stated'}")
    return "At the time: " + ", ".join(parts) + "."


def _when(moment: datetime | str | None) -> str:
    if isinstance(moment, datetime):
        return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
    return str(moment or "")


def _span(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 60:.1f} minutes"
