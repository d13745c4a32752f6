"""Thin long time series for drawing, keeping what a person looks for: the peaks and the dips.

A chart is about 1000 pixels wide, so a recording of hours at 0.5 s holds far more samples
than can be drawn. Averaging would flatten a one-sample spike of swap traffic or a VRAM peak
that came close to an out-of-memory error; instead each time bucket keeps its minimum and its
maximum, in time order, so the drawn envelope is exactly the envelope of the data.
"""

from __future__ import annotations

Point = tuple[float, float | None]  # (time, value); a None value is a gap in the line


def downsample_minmax(points: list[Point], max_points: int) -> list[Point]:
    """At most ``max_points`` points (about: two per bucket) with every bucket's min and max.

    ``points`` must be in time order. A bucket with no measured value becomes one gap point,
    so a stretch where a reading was unavailable stays visible as a break in the line.
    """
    if max_points < 2:
        raise ValueError("max_points must be at least 2")
    if len(points) <= max_points:
        return list(points)
    buckets = max_points // 2
    t0 = points[0][0]
    span = points[-1][0] - t0
    if span <= 0:
        return _by_count(points, buckets)
    width = span / buckets
    out: list[Point] = []
    current: list[Point] = []
    current_index = 0
    for point in points:
        index = min(buckets - 1, int((point[0] - t0) / width))
        if index != current_index and current:
            out.extend(_reduce(current))
            current = []
        current_index = index
        current.append(point)
    if current:
        out.extend(_reduce(current))
    return out


def _by_count(points: list[Point], buckets: int) -> list[Point]:
    size = -(-len(points) // buckets)
    out: list[Point] = []
    for start in range(0, len(points), size):
        out.extend(_reduce(points[start : start + size]))
    return out


def _reduce(bucket: list[Point]) -> list[Point]:
    measured = [(i, p) for i, p in enumerate(bucket) if p[1] is not None]
    if not measured:
        return [(bucket[0][0], None)]
    low = min(measured, key=lambda ip: ip[1][1])
    high = max(measured, key=lambda ip: ip[1][1])
    if low[0] == high[0]:
        return [low[1]]
    first, second = (low, high) if low[0] < high[0] else (high, low)
    return [first[1], second[1]]
