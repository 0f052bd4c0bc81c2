"""The geometry of the incident page's chart of affected responses over time: bars in an SVG box,
with a count axis (0, half the peak, the peak) and a time axis (five ticks across the window).

Numbers only: the template (``monitor/api/templates/incident.html``) writes the markup, so nothing
here is ever marked safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

#: The box, and the room kept for the count axis's labels (left) and the time axis's (below).
WIDTH, HEIGHT, LEFT, AXIS = 640, 140, 44, 18
#: Ticks on the time axis, ends included.
TIME_TICKS = 5


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    count: int
    start: datetime


@dataclass(frozen=True)
class Tick:
    """One labelled tick: where it is on its axis, and what it says (a count or a time)."""

    at: float
    count: int | None = None
    moment: datetime | None = None


@dataclass(frozen=True)
class Chart:
    bars: list[Bar]
    peak: int
    first: datetime
    last: datetime
    counts: list[Tick]  # y positions of 0, half the peak and the peak
    times: list[Tick]  # x positions across the window
    bucket_seconds: int = 60  # what one bar counts
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    axis: int = AXIS

    @property
    def base(self) -> int:
        """The y of the time axis (the bars' foot)."""
        return self.height - self.axis


def chart_of(counts: list[int], start: datetime, bucket_seconds: int) -> Chart | None:
    """Return the chart of ``counts`` per bucket from ``start``; None when there is nothing to draw."""
    peak = max(counts, default=0)
    if peak == 0:
        return None
    plot = WIDTH - LEFT
    base = HEIGHT - AXIS
    step = plot / len(counts)
    bars = []
    for i, n in enumerate(counts):
        if n:
            h = max(1.0, (base - 6) * n / peak)
            moment = start + timedelta(seconds=i * bucket_seconds)
            bars.append(Bar(round(LEFT + i * step, 1), round(base - h, 1), round(max(1.0, step - 1), 1),
                            round(h, 1), n, moment))  # fmt: skip
    span = len(counts) * bucket_seconds
    last = start + timedelta(seconds=span)
    levels = sorted({0, peak // 2, peak})
    count_ticks = [Tick(round(base - (base - 6) * n / peak, 1), count=n) for n in levels]
    time_ticks = [
        Tick(
            round(LEFT + plot * k / (TIME_TICKS - 1), 1),
            moment=start + timedelta(seconds=span * k / (TIME_TICKS - 1)),
        )
        for k in range(TIME_TICKS)
    ]
    return Chart(bars, peak, start, last, count_ticks, time_ticks)
