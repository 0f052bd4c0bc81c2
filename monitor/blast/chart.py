"""The geometry of the incident page's chart of affected responses over time: bars in an SVG box
stretched to the page's width, a count axis (0, half the peak, the peak) and a time axis (five
ticks across the window).

The axes' labels are the page's text, placed beside the box at a percentage of it, not SVG text:
an SVG scaled down to a phone's width scales its text too (labels 10 units high in a 640-unit box
were 5.6 px on a 390 px screen), where the page's text keeps its size. So the bars have a box of
their own units (``WIDTH`` x ``HEIGHT``, drawn stretched), and each tick says where it is as a
percentage of its axis.

Numbers only: the template (``monitor/api/templates/incident.html``) writes the markup, so nothing
here is ever marked safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

#: The bars' box in its own units; the page stretches it to its width and the chart's height.
WIDTH, HEIGHT = 1000, 100
#: Units kept above the peak's bar, so that the peak's label and line do not sit on the box's edge.
HEADROOM = 8
#: Ticks on the time axis, ends included.
TIME_TICKS = 5
#: Of a bucket's width, the share its bar fills: the rest is the gap that tells bars apart.
BAR_SHARE = 0.8


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
    """One labelled tick: where it is on its axis (a percentage: of the width from the left for a
    time, of the height from the top for a count), and what it says."""

    at: float
    count: int | None = None
    moment: datetime | None = None

    @property
    def y(self) -> float:
        """Its height in the bars' units (a count's line across the box)."""
        return round(self.at * HEIGHT / 100, 2)

    @property
    def x(self) -> float:
        """Its place in the bars' units (a time's mark on the axis)."""
        return round(self.at * WIDTH / 100, 2)


@dataclass(frozen=True)
class Chart:
    bars: list[Bar]
    peak: int
    first: datetime
    last: datetime
    counts: list[Tick]  # 0, half the peak and the peak, from the bottom up
    times: list[Tick]  # across the window, its ends included
    bucket_seconds: int = 60  # what one bar counts
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def bucket_said(self) -> str:
        """What one bar counts, as a reader says it: "60 s", "2 min 31 s", "5 min"."""
        minutes, seconds = divmod(self.bucket_seconds, 60)
        if minutes < 2:
            return f"{self.bucket_seconds} s"
        return f"{minutes} min" + (f" {seconds} s" if seconds else "")


def chart_of(
    counts: list[int], start: datetime, bucket_seconds: int, end: datetime | None = None
) -> Chart | None:
    """Return the chart of ``counts`` per bucket from ``start`` to ``end`` (default: the buckets'
    end; a window's end falls inside its last bucket); None when there is nothing to draw."""
    peak = max(counts, default=0)
    if peak == 0:
        return None
    span = len(counts) * bucket_seconds
    if end is not None and 0 < (end - start).total_seconds() < span:
        span = int((end - start).total_seconds()) or span
    per_second = WIDTH / span
    step = bucket_seconds * per_second
    tall = HEIGHT - HEADROOM
    bars = []
    for i, n in enumerate(counts):
        x = i * step
        if n and x < WIDTH:  # a bucket past the window's end holds nothing of it
            h = max(0.8, tall * n / peak)
            width = min(step * BAR_SHARE, WIDTH - x)
            moment = start + timedelta(seconds=i * bucket_seconds)
            bars.append(Bar(round(x, 2), round(HEIGHT - h, 2), round(width, 2), round(h, 2), n, moment))
    levels = sorted({0, peak // 2, peak})
    count_ticks = [Tick(round(100 * (HEIGHT - tall * n / peak) / HEIGHT, 2), count=n) for n in levels]
    shares = [k / (TIME_TICKS - 1) for k in range(TIME_TICKS)]
    time_ticks = [Tick(round(100 * k, 2), moment=start + timedelta(seconds=span * k)) for k in shares]
    last = start + timedelta(seconds=span)
    return Chart(bars, peak, start, last, count_ticks, time_ticks, bucket_seconds)
