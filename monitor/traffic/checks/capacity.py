"""The capacity check: a 2xx for a prompt over its node's smallest KV pool (the node's own
capacity reading, ``monitor/traffic/facts.py``) is a ``mismatch``: admission that does not refuse.

The prompt's size is the reported count where that is plausible, else the floor of the tokens
check (the densest text the probes saw): an over-pool prompt whose count was faked may pass, but
one flagged on the floor is over.
"""

from __future__ import annotations

from kvcanary.monitor.traffic.checks.base import CheckContext, Finding, TrafficCheck
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.probes.base import Verdict

#: A prompt this close to its node's pool is kept as a row (what a blast radius needs later).
NEAR_POOL = 0.9


class CapacityCheck(TrafficCheck):
    name = "capacity"
    needs = frozenset({"estimate", "pool"})
    judges_pool = True

    def judge(self, record: TrafficRecord, context: CheckContext) -> Finding | None:
        """Flag an answered prompt over the pool; None where the size or the pool is not known."""
        estimate, pool = context.estimate, context.pool
        if estimate is None or not pool or not record.ok:
            return None
        if estimate <= pool:
            return self.passed
        figures = {
            "estimated_prompt_tokens": round(estimate),
            "kv_pool_tokens": pool,
            "status": record.status,
        }
        return Finding(self.name, Verdict.MISMATCH, "over_pool_answered", figures)
