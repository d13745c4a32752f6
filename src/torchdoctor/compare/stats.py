"""The statistics of a comparison: a ratio of medians of block means, with a block bootstrap
interval.

A run's steady steps are cut into consecutive blocks of about sqrt(n) steps, after the slowest
2 % of steps are brought down to the 98th percentile (winsorized). A run's figure for a series
(step time, data wait...) is the median of its blocks' means; the verdict is the ratio B / A of
those figures. Why this one (and not a ratio of plain medians, a t-test on means or
Hodges-Lehmann):

- a step's time is often bimodal: with DataLoader workers, batches arrive in bursts, one step
  waits for a worker and the next ones find their batch ready. A plain median then sits in one
  mode or the other (2 workers: half the steps wait ~20 ms, half ~0, and the median is either:
  0.963x with an interval of 0.016 to 0.971 on a run 2.2x faster) and says nothing of
  throughput. A block's mean covers whole bursts: it is the throughput there;
- outliers must not decide: a rare one (a checkpoint save, a garbage collection) is capped by
  the winsorizing, and a stretch of slow steps (a neighbour's burst of load) raises a few
  blocks, which the median of the blocks passes over. Slow steps every few steps (more often
  than 1 in 50) are the job's pace and count;
- steps are not independent (the bursts, the machine's load drifting): resampling single steps,
  as Hodges-Lehmann's interval and a plain bootstrap assume, makes the interval too narrow.
  Resampling whole blocks (a non-overlapping block bootstrap) keeps that structure;
- a ratio reads the same for a 20 ms and a 2 s step, so ``--fail-if-slower 5`` means 5 %;
- the resampling is seeded, so the same two recordings always give the same interval.

The interval is the percentile interval of the bootstrap distribution. It measures the
uncertainty *within* the two runs; two runs of the same command also differ *between* them
(a machine busier during one: the comparison says so from the host samples), which is why the
verdict also has a practical band (:mod:`torchdoctor.compare.verdict`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torchdoctor.recording.steps import quantile

CONFIDENCE = 0.95
RESAMPLES = 2000  # percentile ends at 95 % are stable to about 1 % of the width at 2000
SEED = 20240043  # any fixed number: the same recordings give the same interval every time
WINSOR_Q = 0.98  # steps above this quantile are rare outliers, capped (see the module doc)


@dataclass(frozen=True, slots=True)
class Interval:
    """An estimate and its ~95 % interval (``low`` <= ``estimate`` <= ``high`` as a rule)."""

    estimate: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


def block_length(n: int) -> int:
    """Steps per block: about sqrt(n) - as many blocks as steps in a block, so that a block
    covers a DataLoader's burst of batches and the load's drift, and there are still blocks
    enough to resample - and at least 4 (a run of 20 steps is 5 blocks of 4)."""
    return max(1, min(n, max(4, round(math.sqrt(n)))))


def winsorized(values: Sequence[float], q: float = WINSOR_Q) -> list[float]:
    """``values`` with those above their ``q`` quantile brought down to it."""
    cap = quantile(list(values), q)
    return [min(v, cap) for v in values]


def _blocks(values: Sequence[float]) -> list[tuple[float, int]]:
    """(sum, count) of consecutive blocks of :func:`block_length` steps, every step in one
    (the blocks differ in length by one step at most)."""
    n = len(values)
    if n == 0:
        return []
    g = max(1, n // block_length(n))
    bounds = [i * n // g for i in range(g + 1)]
    return [(math.fsum(values[lo:hi]), hi - lo) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def _percentiles(values: list[float], confidence: float) -> tuple[float, float]:
    ordered = sorted(values)
    tail = (1 - confidence) / 2
    lo = ordered[int(math.floor(tail * (len(ordered) - 1)))]
    hi = ordered[int(math.ceil((1 - tail) * (len(ordered) - 1)))]
    return lo, hi


@dataclass(frozen=True, slots=True)
class PairedSeries:
    """The same steps of two runs seen through several series (step wall, data wait...):
    ``a[name]`` and ``b[name]`` are lists as long as run A's and run B's steady steps. The
    bootstrap resamples *blocks of steps*, so every series of a run shares the resampled
    blocks."""

    a: dict[str, list[float]]
    b: dict[str, list[float]]


def typical_step(values: Sequence[float]) -> float:
    """A run's figure for a series: the median of its block means (see the module doc)."""
    blocks = _blocks(winsorized(values))
    return statistics.median(_block_means(blocks, range(len(blocks))))


def _block_means(blocks: list[tuple[float, int]], picks: Iterable[int]) -> list[float]:
    return [blocks[i][0] / blocks[i][1] for i in picks]


def bootstrap(
    series: PairedSeries,
    ratio_of: str,
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[Interval, dict[str, Interval]]:
    """The ratio B / A of :func:`typical_step` of the series ``ratio_of``, and the difference
    B - A of every series, each with its bootstrap interval.

    A ratio needs A's figure above zero: otherwise the ratio is NaN."""
    names = list(series.a)
    a = {k: _blocks(winsorized(v)) for k, v in series.a.items()}
    b = {k: _blocks(winsorized(v)) for k, v in series.b.items()}
    ga, gb = len(a[ratio_of]), len(b[ratio_of])
    if ga == 0 or gb == 0:
        raise ValueError("both runs need at least one step")
    rng = random.Random(seed)
    ratios: list[float] = []
    deltas: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(resamples):
        ia = [rng.randrange(ga) for _ in range(ga)]
        ib = [rng.randrange(gb) for _ in range(gb)]
        for k in names:
            ma = statistics.median(_block_means(a[k], ia))
            mb = statistics.median(_block_means(b[k], ib))
            deltas[k].append(mb - ma)
            if k == ratio_of:
                ratios.append(mb / ma if ma > 0 else math.nan)
    point = {k: (typical_step(series.a[k]), typical_step(series.b[k])) for k in names}
    ma, mb = point[ratio_of]
    finite = [r for r in ratios if math.isfinite(r)]
    if ma > 0 and finite:
        lo, hi = _percentiles(finite, confidence)
        ratio = Interval(mb / ma, lo, hi)
    else:
        ratio = Interval(math.nan, math.nan, math.nan)
    diffs = {}
    for k in names:
        lo, hi = _percentiles(deltas[k], confidence)
        diffs[k] = Interval(point[k][1] - point[k][0], lo, hi)
    return ratio, diffs


def step_ratio(a: Sequence[float], b: Sequence[float]) -> Interval:
    """B's step time over A's with its interval: the figure of ``torchdoctor compare``'s
    verdict for two lists of steady step times (seconds). Below 1 is faster."""
    ratio, _ = bootstrap(PairedSeries({"step": list(a)}, {"step": list(b)}), "step")
    return ratio


def speedup(a: Sequence[float], b: Sequence[float]) -> Interval:
    """How many times faster B runs than A (A's step time over B's), with its interval: the
    one definition behind every "x1.8 faster" torchdoctor prints (compare's verdict, tune's
    verified gain, the advice benchmark's ratios). It is :func:`step_ratio` inverted, so the
    interval's ends swap."""
    r = step_ratio(a, b)
    if not (r.estimate > 0 and r.low > 0 and r.high > 0):
        return Interval(math.nan, math.nan, math.nan)
    return Interval(1 / r.estimate, 1 / r.high, 1 / r.low)


# -- Several runs a side ---------------------------------------------------------------------
#
# One run a side sees only the noise *within* the two runs. Several runs of each side show the
# noise *between* runs too (the machine's load, where the threads land, caches: about +-4 % on
# a shared 2-CPU VM, compare_power), which is what decides whether a 5 % change is real. Each
# run is then one observation, its figure :func:`typical_step`, and the interval is Welch's t
# interval on the runs' figures: on their logarithms for the ratio of step times (a ratio is a
# difference of logarithms, and step times spread in proportion to their size), on the figures
# themselves for a phase's difference in seconds (a phase can be zero). Why t and not a
# bootstrap over runs: with 2 to 10 runs a side, resampling runs gives intervals too narrow
# (the bootstrap's variance is short by a factor (n - 1) / n and its quantiles are those of a
# handful of distinct values); the t interval is exact for normal figures and close for the
# near-normal means of many steps. Welch, not the pooled t: a change can also change the spread.


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz's
    method), converging quickly for ``x < (a + 1) / (a + b + 2)``."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0 < p < 1) of Student's t with ``df`` degrees of freedom, by
    bisection on :func:`student_t_cdf` (to about 1e-10; t(0.975, 1) = 12.706)."""
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -student_t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2


def welch_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE
) -> Interval:
    """mean(b) - mean(a) with Welch's t interval; each side needs at least 2 values. Two sides
    without any spread give an interval of width zero."""
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        raise ValueError("Welch's interval needs at least 2 values a side")
    diff = statistics.fmean(b) - statistics.fmean(a)
    va, vb = statistics.variance(a) / na, statistics.variance(b) / nb
    se2 = va + vb
    if se2 <= 0:
        return Interval(diff, diff, diff)
    # Welch-Satterthwaite's degrees of freedom; a side without spread adds none of its own.
    df = se2 * se2 / sum(v * v / (n - 1) for v, n in ((va, na), (vb, nb)) if v > 0)
    half = student_t_quantile(1 - (1 - confidence) / 2, df) * math.sqrt(se2)
    return Interval(diff, diff - half, diff + half)


def runs_step_ratio(a: Sequence[float], b: Sequence[float]) -> Interval:
    """B's step time over A's from several runs a side, ``a`` and ``b`` each run's figure
    (:func:`typical_step`, seconds, above zero): the ratio of their geometric means with
    Welch's interval on the logarithms, back on the ratio scale (see above)."""
    if any(v <= 0 for v in (*a, *b)):
        return Interval(math.nan, math.nan, math.nan)
    d = welch_interval([math.log(v) for v in a], [math.log(v) for v in b])
    return Interval(math.exp(d.estimate), math.exp(d.low), math.exp(d.high))
