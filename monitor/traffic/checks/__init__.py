"""Traffic checks, registered in judging order. One file per check; one explicit line per check here.

Every customer record gets each check of :data:`REGISTRY`, in this order (the windowed checks last:
each adds the exchange to its window after judging it, the reworded check keeping out an answer
an earlier check found a leak). The rules, and how sure each is, are in
docs/operating.md ("Judging real traffic") and docs/detection.md; what a check is, ``base.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvcanary.monitor.traffic.checks.base import CheckContext, Finding, TrafficCheck
from kvcanary.monitor.traffic.checks.capacity import NEAR_POOL, CapacityCheck
from kvcanary.monitor.traffic.checks.marker import MarkerCheck
from kvcanary.monitor.traffic.checks.overlap_run import (
    OVERLAP_MIN_RUN,
    OverlapCheck,
    longest_unexcused_run,
    overlap_check,
)
from kvcanary.monitor.traffic.checks.reworded import REWORDED_MIN_TOKENS, RewordedCheck
from kvcanary.monitor.traffic.checks.tokens import TOKENS_MARGIN, TokensCheck, prompt_estimate

REGISTRY: tuple[TrafficCheck, ...] = (
    MarkerCheck(),
    TokensCheck(),
    CapacityCheck(),
    OverlapCheck(),
    RewordedCheck(),
)

#: The checks' names: the ``check`` label and query parameter, and the kept rows' ``checks`` column.
CHECKS = tuple(check.name for check in REGISTRY)
#: Each check by the kind its results are stored under: how a stored result or an incident, which
#: keep only that kind, finds the check that made it.
BY_RESULT_KIND: Mapping[str, TrafficCheck] = {check.result_kind: check for check in REGISTRY}

__all__ = [
    "BY_RESULT_KIND",
    "CHECKS",
    "NEAR_POOL",
    "OVERLAP_MIN_RUN",
    "REGISTRY",
    "REWORDED_MIN_TOKENS",
    "TOKENS_MARGIN",
    "CheckContext",
    "Finding",
    "TrafficCheck",
    "longest_unexcused_run",
    "overlap_check",
    "prompt_estimate",
]
