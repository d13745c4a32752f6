"""Thin long time series for drawing, keeping what a person looks for: the peaks and the dips.

A chart is about 1000 pixels wide, so a recording of hours at 0.5 s holds far more samples
than can be drawn. Averaging would flatten a one-sample spike of swap traffic or a VRAM peak
that came close to an out-of-memory error; instead each time bucket keeps its minimum and its
maximum, in time order, so the drawn envelope is exactly the envelope of the data.
"""

from __future__ import annotations

import math

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
    span = points[-1][0] - points[0][0]
    if span <= 0:
        return _by_count(points, max_points // 2)
    stream = MinMaxStream(points[0][0], points[-1][0], max_points)
    for t, v in points:
        stream.add(t, v)
    return stream.points()


class MinMaxStream:
    """:func:`downsample_minmax` fed one point at a time, for series too long to hold.

    Given the series' first and last times up front (a SQL MIN/MAX), it keeps the points
    until there are more than ``max_points``, then only the bucket being filled: its first
    time and the first minimum and first maximum seen, which is what ``_reduce`` keeps. Fed
    the same points it returns the same list, so a long recording's chart has exactly the
    envelope its samples have.
    """

    __slots__ = (
        "max_points",
        "buckets",
        "t0",
        "width",
        "held",
        "out",
        "index",
        "first",
        "low",
        "high",
        "seen",
    )

    def __init__(self, t_first: float, t_last: float, max_points: int) -> None:
        if max_points < 2:
            raise ValueError("max_points must be at least 2")
        self.max_points = max_points
        self.buckets = max_points // 2
        self.t0 = t_first
        span = t_last - t_first
        # All points at one time (never in a per-instant series): one bucket holds them.
        self.width = span / self.buckets if span > 0 else math.inf
        self.held: list[Point] | None = []  # None once bucketing
        self.out: list[Point] = []
        self.index = 0
        self.first: Point | None = None  # the current bucket's first point
        self.low: tuple[int, Point] | None = None  # (position in the bucket, point)
        self.high: tuple[int, Point] | None = None
        self.seen = 0  # points in the current bucket

    def add(self, t: float, v: float | None) -> None:
        held = self.held
        if held is not None:
            held.append((t, v))
            if len(held) <= self.max_points:
                return
            self.held = None
            for point in held:
                self._bucket(point)
            return
        self._bucket((t, v))

    def _bucket(self, point: Point) -> None:
        index = min(self.buckets - 1, int((point[0] - self.t0) / self.width))
        if index != self.index and self.first is not None:
            self._flush()
        self.index = index
        if self.first is None:
            self.first = point
        v = point[1]
        if v is not None:
            # Strict comparisons keep the first minimum and maximum, as min() and max() do.
            if self.low is None or v < self.low[1][1]:  # type: ignore[operator]
                self.low = (self.seen, point)
            if self.high is None or v > self.high[1][1]:  # type: ignore[operator]
                self.high = (self.seen, point)
        self.seen += 1

    def _flush(self) -> None:
        low, high = self.low, self.high
        if low is None or high is None:
            assert self.first is not None
            self.out.append((self.first[0], None))
        elif low[0] == high[0]:
            self.out.append(low[1])
        else:
            first, second = (low, high) if low[0] < high[0] else (high, low)
            self.out += [first[1], second[1]]
        self.first = self.low = self.high = None
        self.seen = 0

    def points(self) -> list[Point]:
        """The points to draw: every point fed while there were at most ``max_points``."""
        if self.held is not None:
            return list(self.held)
        if self.first is not None:
            self._flush()
        return self.out


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
