"""The diagnosis' "sustained" judgement over a series streamed from SQLite, one point at a time.

:func:`torchdoctor.diagnosis.series.sustained_span` needs the whole series as a list, which a
week of samples makes hundreds of MiB. It slides a window of ``thresholds.sustained_s`` over
the samples; this does the same with a deque holding one window, so the memory is one window
of samples whatever the recording's length. Given the same series and the same ``slack``
(the median gap between samples, which the SQL reading computes up front) it finds the same
span: the same windows qualify, they merge the same way, and the span's mean is summed in the
same order. ``tests/report/test_report_long.py`` checks that against ``sustained_span``.
"""

from __future__ import annotations

from collections import deque

from torchdoctor.diagnosis.series import Span
from torchdoctor.thresholds import Thresholds

EPS = 1e-9  # sustained_span's tolerance on window edges


class SustainedStream:
    """The longest sustained span above ``limit`` of a series fed in time order.

    ``t_first`` and ``t_last`` are the first and last times of the measured points, ``slack``
    the median gap between consecutive ones (``sorted(gaps)[len(gaps) // 2]``).
    """

    def __init__(
        self, limit: float, th: Thresholds, t_first: float, t_last: float, slack: float
    ) -> None:
        self.limit = limit
        self.fraction = th.sustained_fraction
        self.window = min(th.sustained_s, t_last - t_first)
        self.t_last = t_last
        self.slack = slack
        self.win: deque[tuple[int, float, float, bool]] = deque()  # (index, t, v, beyond)
        self.hits = 0  # beyond the limit, in win
        self.n = 0
        # The span being grown: [start index, end index], t_start, t_end, sum, peak, samples.
        self.current: list | None = None
        self.best: Span | None = None

    def add(self, t: float, v: float) -> None:
        while self.win and t - self.win[0][1] > self.window + EPS:
            self._judge()  # the window starting at win[0] is complete: win is that window
            self._pop()
        beyond = v > self.limit
        self.win.append((self.n, t, v, beyond))
        self.hits += beyond
        self.n += 1

    def span(self) -> Span | None:
        """The longest sustained span, as ``sustained_span`` gives it; None if none."""
        if self.n >= 3:
            while self.win:
                self._judge()
                self._pop()
        self._close()
        return self.best if self.n >= 3 else None

    def _pop(self) -> None:
        self.hits -= self.win.popleft()[3]

    def _judge(self) -> None:
        i, t_i = self.win[0][0], self.win[0][1]
        j, t_j = self.win[-1][0], self.win[-1][1]
        if self.t_last - t_i < self.window - self.slack - EPS:
            return  # this window and every later one is shorter than the sustained window
        if t_j - t_i < self.window - self.slack - EPS or j - i + 1 < 3:
            return  # a gap in the samples
        if self.hits / (j - i + 1) < self.fraction:
            return
        current = self.current
        if current is not None and i <= current[1]:
            # Overlaps the span being grown: add the samples after its end, oldest first.
            new = [p for p in reversed(self.win) if p[0] > current[1]]
            for p in reversed(new):
                current[4] += p[2]
                current[5] = max(current[5], p[2])
                current[6] += 1
            current[1], current[3] = j, t_j
            return
        self._close()
        values = [p[2] for p in self.win]
        total = 0.0
        for value in values:
            total += value
        self.current = [i, j, t_i, t_j, total, max(values), len(values)]

    def _close(self) -> None:
        c = self.current
        if c is None:
            return
        self.current = None
        # max() over spans keeps the first of the longest: replace only when strictly longer.
        if self.best is None or c[3] - c[2] > self.best.t_end - self.best.t_start:
            self.best = Span(t_start=c[2], t_end=c[3], mean=c[4] / c[6], peak=c[5], samples=c[6])
