"""One time series of a report, reduced while it streams past: what a chart and the summary
need of it, in memory bounded by the chart's resolution instead of the series' length.

A :class:`ReadingBuilder` is fed the series' (UNIX time, value) points in time order and
keeps: the points to draw (min/max per bucket, :class:`~torchdoctor.report.downsample.
MinMaxStream`), the count, mean and peak of the measured values, and for each limit asked the
longest sustained span beyond it (:class:`~torchdoctor.report.sustained.SustainedStream`).
Each is what the report computed from the whole list before, in the same order and the same
arithmetic, so the figures are the same ones (the mean is a plain running sum, as ``sum()``
was before Python 3.12 compensated it: on 3.12 the two can differ in the last digit).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torchdoctor.diagnosis.series import Span
from torchdoctor.report.downsample import MinMaxStream, Point
from torchdoctor.report.sustained import SustainedStream
from torchdoctor.thresholds import Thresholds


@dataclass(slots=True)
class Reading:
    """A series as the report uses it. Points are in seconds since the run's start."""

    points: list[Point]
    samples: int  # measured values
    mean: float | None
    peak: float | None
    spans: dict[float, Span | None] = field(default_factory=dict)  # per limit asked

    @property
    def measured(self) -> bool:
        return self.samples > 0


EMPTY = Reading(points=[], samples=0, mean=None, peak=None)


@dataclass(slots=True)
class Extent:
    """What must be known of a series before it streams: where it starts and ends (all its
    points, and its measured ones), and the median gap between measured points."""

    t_first: float | None = None
    t_last: float | None = None
    measured_first: float | None = None
    measured_last: float | None = None
    slack: float | None = None  # only needed where a sustained span is asked for


class ReadingBuilder:
    """Builds a :class:`Reading` from points fed in time order (see the module doc)."""

    __slots__ = ("t0", "minmax", "count", "total", "peak", "sustained")

    def __init__(
        self,
        extent: Extent,
        t0: float,
        max_points: int,
        th: Thresholds,
        limits: Iterable[float] = (),
    ) -> None:
        self.t0 = t0
        first = extent.t_first if extent.t_first is not None else t0
        last = extent.t_last if extent.t_last is not None else first
        # make_series shifted times before downsampling: the same subtraction, same buckets.
        self.minmax = MinMaxStream(first - t0, last - t0, max_points)
        self.count = 0
        self.total: float = 0
        self.peak: float | None = None
        self.sustained: dict[float, SustainedStream | None] = {}
        for limit in limits:
            known = (extent.measured_first, extent.measured_last, extent.slack)
            self.sustained[limit] = (
                None if None in known else SustainedStream(limit, th, *known)  # type: ignore[arg-type]
            )

    def add(self, t: float, v: float | None) -> None:
        self.minmax.add(t - self.t0, v)
        if v is None:
            return
        self.count += 1
        self.total += v
        if self.peak is None or v > self.peak:
            self.peak = v
        for stream in self.sustained.values():
            if stream is not None:
                stream.add(t, v)

    def reading(self) -> Reading:
        if not self.count:
            return EMPTY
        return Reading(
            points=self.minmax.points(),
            samples=self.count,
            mean=self.total / self.count,
            peak=self.peak,
            spans={
                limit: (stream.span() if stream is not None else None)
                for limit, stream in self.sustained.items()
            },
        )


def read_points(
    points: Iterable[Point],
    extent: Extent,
    t0: float,
    max_points: int,
    th: Thresholds,
    limits: Iterable[float] = (),
) -> Reading:
    """The reading of ``points`` (in time order) whose extent is known."""
    builder = ReadingBuilder(extent, t0, max_points, th, limits)
    for t, v in points:
        builder.add(t, v)
    return builder.reading()
