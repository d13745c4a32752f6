"""The statistics of a comparison: a ratio of medians with a moving-block bootstrap interval.

Why this one (and not a t-test on means or Hodges-Lehmann):

- step times have outliers (a checkpoint save, a garbage collection, a worker respawn) that drag
  a mean and its variance far from a typical step; the median ignores them;
- a ratio (B / A) reads the same for a 20 ms and a 2 s step, so ``--fail-if-slower 5`` means
  5 % whatever the job;
- steps are not independent: DataLoader workers hand out batches in bursts (a wait every
  ``num_workers``-th step), the machine's load drifts. Hodges-Lehmann's interval and any
  resampling of single steps assume independence and come out too narrow. Resampling runs of
  consecutive steps (blocks) keeps that structure inside each resampled series;
- the resampling is seeded, so the same two recordings always give the same interval.

The interval is the percentile interval of the bootstrap distribution. It measures the
uncertainty *within* the two runs; two runs of the same command on a shared machine also differ
between them, which is why a verdict also has a practical band (:data:`NO_CHANGE_BAND`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
RESAMPLES = 1000  # percentile ends at 95 % are stable to about 1 % of the width at 1000
SEED = 20240043  # any fixed number: the same recordings give the same interval every time
# Longer series are thinned to this many steps, evenly spread, before resampling: the cost
# stays flat for a day of steps, and the interval, from fewer steps, can only come out wider.
MAX_STEPS = 2000


@dataclass(frozen=True, slots=True)
class Interval:
    """An estimate and its ~95 % interval (``low`` <= ``estimate`` <= ``high`` as a rule)."""

    estimate: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


def block_length(n: int) -> int:
    """Steps per resampled block: about n^(1/3) (the usual rate for a moving-block bootstrap
    of a median), at least 4 so a worker's burst of batches stays inside one block."""
    return max(1, min(n, max(4, round(n ** (1 / 3)))))


def thin(values: Sequence[float], limit: int = MAX_STEPS) -> list[float]:
    """At most ``limit`` of ``values``, evenly spread, in their order."""
    n = len(values)
    if n <= limit:
        return list(values)
    return [values[i * n // limit] for i in range(limit)]


def _block_indices(n: int, rng: random.Random) -> list[int]:
    """Indices of one moving-block resample of a series of ``n``: blocks of consecutive
    steps starting anywhere, concatenated until there are ``n`` indices."""
    size = block_length(n)
    starts = n - size + 1
    out: list[int] = []
    while len(out) < n:
        s = rng.randrange(starts)
        out.extend(range(s, s + size))
    del out[n:]
    return out


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
    bootstrap resamples *steps*, so every series of a run shares the resampled indices."""

    a: dict[str, list[float]]
    b: dict[str, list[float]]


def bootstrap(
    series: PairedSeries,
    ratio_of: str,
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[Interval, dict[str, Interval]]:
    """The ratio of medians B / A of the series ``ratio_of``, and the difference of medians
    B - A of every series, each with its bootstrap interval.

    A ratio needs A's median above zero: a series whose median is 0 gets a ratio of NaN."""
    names = list(series.a)
    a = {k: thin(v) for k, v in series.a.items()}
    b = {k: thin(v) for k, v in series.b.items()}
    na, nb = len(a[ratio_of]), len(b[ratio_of])
    if na == 0 or nb == 0:
        raise ValueError("both runs need at least one step")
    rng = random.Random(seed)
    ratios: list[float] = []
    deltas: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(resamples):
        ia = _block_indices(na, rng)
        ib = _block_indices(nb, rng)
        for k in names:
            ma = statistics.median([a[k][i] for i in ia])
            mb = statistics.median([b[k][i] for i in ib])
            deltas[k].append(mb - ma)
            if k == ratio_of:
                ratios.append(mb / ma if ma > 0 else math.nan)
    point = {k: (statistics.median(a[k]), statistics.median(b[k])) for k in names}
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
