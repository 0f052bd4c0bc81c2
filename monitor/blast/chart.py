"""The geometry of the incident page's chart of affected responses over time: bars in an SVG box.

Numbers only: the template (``monitor/api/templates/incident.html``) writes the markup, so nothing
here is ever marked safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

WIDTH, HEIGHT, AXIS = 600, 120, 16


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    count: int
    start: datetime


@dataclass(frozen=True)
class Chart:
    bars: list[Bar]
    peak: int
    first: datetime
    last: datetime
    width: int = WIDTH
    height: int = HEIGHT
    axis: int = AXIS


def chart_of(counts: list[int], start: datetime, bucket_seconds: int) -> Chart | None:
    """Return the chart of ``counts`` per bucket from ``start``; None when there is nothing to draw."""
    peak = max(counts, default=0)
    if peak == 0:
        return None
    step = WIDTH / len(counts)
    bars = []
    for i, n in enumerate(counts):
        if n:
            h = max(1.0, (HEIGHT - AXIS) * n / peak)
            moment = start + timedelta(seconds=i * bucket_seconds)
            bars.append(Bar(round(i * step, 1), round(HEIGHT - AXIS - h, 1), round(max(1.0, step - 1), 1),
                            round(h, 1), n, moment))  # fmt: skip
    last = start + timedelta(seconds=len(counts) * bucket_seconds)
    return Chart(bars, peak, start, last)
