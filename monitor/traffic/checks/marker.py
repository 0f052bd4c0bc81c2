"""The marker check: a live marker of this monitor in a customer's response is a probe's KV in a
customer's answer, a ``leak``. A forged or expired marker-shaped string is nobody's: the marker
book (``probes/markers.py``) knows only the live, sealed ones.
"""

from __future__ import annotations

from kvcanary.monitor.traffic.checks.base import CheckContext, Finding, TrafficCheck
from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.probes.base import Verdict


class MarkerCheck(TrafficCheck):
    name = "marker"
    needs = frozenset({"markers", "target"})

    def judge(self, record: TrafficRecord, context: CheckContext) -> Finding:
        """Flag a record carrying a live marker; its evidence names each one (ids and hashes only)."""
        if not record.markers:
            return self.passed
        hits = context.markers.scan(" ".join(record.markers), target=context.target, reader="")
        if not hits:
            return self.passed
        markers = [
            {"marker_id": h.marker_id, "marker_sha256": h.digest, "owner_target": h.owner_target,
             "owner_tenant": h.owner_tenant}
            for h in hits
        ]  # fmt: skip
        return Finding(
            self.name, Verdict.LEAK, "probe_marker_in_customer_response",
            figures={"markers": len(hits)}, evidence={"markers": markers},
        )  # fmt: skip
