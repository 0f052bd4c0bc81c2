"""What a blast radius asks of every source: a window, a criterion and a scope.

A source answers with counts only: request ids, callers and times, never a prompt or a response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

#: ``over_pool``: requests over the node's pool answered 2xx; ``flagged``: the records a traffic
#: check flagged; ``at_risk``: every request to the node; ``none``: an availability incident.
CriterionKind = Literal["over_pool", "flagged", "at_risk", "none"]
#: How far the chart's time axis is cut.
BUCKETS = 48


@dataclass(frozen=True)
class Bound:
    at: datetime
    how: str  # how the bound was found, in words


@dataclass(frozen=True)
class Window:
    start: Bound
    end: Bound

    @property
    def seconds(self) -> float:
        return max(0.0, (self.end.at - self.start.at).total_seconds())


@dataclass(frozen=True)
class Criterion:
    kind: CriterionKind
    text: str  # the rule, in words
    pool_tokens: int | None = None  # over_pool: the pool a prompt had to exceed
    check: str | None = None  # flagged: the traffic check (marker, tokens, capacity, overlap)

    @property
    def label(self) -> str:
        """``affected`` where the criterion names the responses, ``at risk`` where it only bounds them."""
        return "at risk" if self.kind == "at_risk" else "affected"


@dataclass(frozen=True)
class Scope:
    """The question every source answers: which of its requests match, grouped by caller and time."""

    target: str
    target_id: int
    node: str
    window: Window
    criterion: Criterion
    #: API bases (``monitor.traffic.judge.api_base_key`` form) whose requests reach the node.
    api_bases: tuple[str, ...]
    #: The target's calibration (``monitor/targets/calibration.py``): a prompt's size in tokens
    #: from its characters where the reported count is implausible. None: reported counts only.
    chars_per_token: float | None
    own_keys: frozenset[str] = field(default_factory=frozenset)
    #: Callers the operator leaves out (counted apart, never in the chart).
    exclude: tuple[str, ...] = ()
    buckets: int = BUCKETS

    @property
    def start_epoch(self) -> float:
        return self.window.start.at.timestamp()

    @property
    def end_epoch(self) -> float:
        return self.window.end.at.timestamp()

    @property
    def bucket_seconds(self) -> int:
        return max(1, int(self.window.seconds // self.buckets) + 1)
