"""What the monitor keeps of the requests a gateway refused before any upstream call (the record's
``refused``: its admission guard or its quarantine, tap protocol version 3).

No engine saw such a request, so no check judges it and it is never an incident's cause: it is what
containment did, not what a deployment did. Every one is counted (``kvcanary_traffic_refused_total``);
rows are kept with the verdict ``refused``, the first ``ROWS_PER_MINUTE`` of each (target, caller,
cause) a minute, since a group every deployment of which is quarantined refuses every request it
gets, and a row each would be as many writes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from kvcanary.monitor.traffic.judged_record import TrafficRecord

#: The kept row's verdict (``storage/models.py``: TRAFFIC_VERDICTS).
REFUSED = "refused"
#: Refusals kept as rows per (target, caller, cause) a minute; the rest are counted only.
ROWS_PER_MINUTE = 20


class RefusalRows:
    """Decides which refusals are kept as rows (module doc), and what a kept one's row says."""

    def __init__(self) -> None:
        self._minute = -1
        self._rows: Counter[tuple[str, str, str]] = Counter()

    def keep(self, target: str, record: TrafficRecord) -> bool:
        """Whether to keep a row of this refusal: one of the first of its key this minute."""
        assert record.refused is not None
        minute = int(record.time // 60)
        if minute != self._minute:
            self._minute, self._rows = minute, Counter()
        key = (target, record.caller, record.refused.by)
        self._rows[key] += 1
        return self._rows[key] <= ROWS_PER_MINUTE


def refused_row(row: dict[str, Any], record: TrafficRecord) -> dict[str, Any]:
    """Return a record's kept row (``judge._row``'s columns) as a refusal's: its verdict and cause."""
    return row | {"verdict": REFUSED, "findings": {"refused": msgspec.to_builtins(record.refused)}}
