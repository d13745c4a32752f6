"""The maths of time series the rules share: (t, value) pairs, sorted by time.

Spans over which a condition held (:func:`sustained_span`), the value sampled nearest a time,
least-squares trends and means. Pure functions of their arguments: no recording is read here.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from torchdoctor.thresholds import Thresholds


@dataclass(slots=True)
class Span:
    """A stretch of time over which a condition held, with the series' figures over it."""

    t_start: float
    t_end: float
    mean: float  # mean of the series over the span
    peak: float
    samples: int

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


def sustained_span(
    series: list[tuple[float, float]], limit: float, thresholds: Thresholds, *, above: bool = True
) -> Span | None:
    if len(series) < 3:
        return None
    series = sorted(series)
    total = series[-1][0] - series[0][0]
    gaps = sorted(b[0] - a[0] for a, b in zip(series, series[1:], strict=False))
    slack = gaps[len(gaps) // 2]  # one sampling interval: windows never line up exactly
    # A series read at a coarse resolution (a week thinned, minutes folded into one row
    # each) holds fewer than 3 samples in sustained_s: the window then spans 3 of them.
    window = min(max(thresholds.sustained_s, 2 * slack), total)
    beyond = [(v > limit) if above else (v < limit) for _, v in series]
    spans: list[tuple[int, int]] = []
    j = 0
    n = len(series)
    for i in range(n):
        j = max(j, i)
        while j + 1 < n and series[j + 1][0] - series[i][0] <= window + 1e-9:
            j += 1
        if series[-1][0] - series[i][0] < window - slack - 1e-9:
            break  # every window from here on is shorter than the sustained window
        if series[j][0] - series[i][0] < window - slack - 1e-9 or j - i + 1 < 3:
            continue  # a gap in the samples (jitter, a stalled recorder): skip this window
        hits = sum(beyond[i : j + 1])
        if hits / (j - i + 1) >= thresholds.sustained_fraction:
            if spans and i <= spans[-1][1]:
                spans[-1] = (spans[-1][0], j)
            else:
                spans.append((i, j))
    if not spans:
        return None
    i, j = max(spans, key=lambda s: series[s[1]][0] - series[s[0]][0])
    values = [v for _, v in series[i : j + 1]]
    return Span(
        t_start=series[i][0],
        t_end=series[j][0],
        mean=sum(values) / len(values),
        peak=max(values) if above else min(values),
        samples=len(values),
    )


def nearest(series: list[tuple[float, float]], t: float, tolerance: float) -> float | None:
    """The value of the sorted ``series`` sampled closest to ``t``, within ``tolerance`` s.

    Host and process readings of one snapshot carry their own read times, a few ms apart.
    """
    i = bisect.bisect_left(series, (t, -math.inf))
    best = None
    for j in (i - 1, i):
        if (
            0 <= j < len(series)
            and abs(series[j][0] - t) <= tolerance
            and (best is None or abs(series[j][0] - t) < abs(best[0] - t))
        ):
            best = series[j]
    return best[1] if best is not None else None


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """Least-squares (slope, intercept, r²) of y on x; None when x does not vary."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    syy = sum((y - my) ** 2 for _, y in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    if sxx <= 0:
        return None
    slope = sxy / sxx
    r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 0.0
    return slope, my - slope * mx, r2


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mean_in(series: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """The mean of the values sampled between ``t0`` and ``t1`` (inclusive)."""
    return mean([v for t, v in series if t0 <= t <= t1])
