"""The largest batch that fits, found by searching over simulated steps (no GPU, no OOM)."""

from __future__ import annotations

import time
from collections.abc import Callable

from torchdoctor.estimate.api import alternatives, estimate_workload
from torchdoctor.estimate.result import Estimate, MaxBatch
from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.workload import Workload

MAX_BATCH = 1 << 20
_MAX_GROWTH = 16


def find_max_batch(
    workload: Workload,
    setup: TrainingSetup,
    target: Target,
    margin: float,
    fallback: bool,
    capacity: int,
    on_probe: Callable[[Estimate], None] | None = None,
) -> MaxBatch:
    """Search the batch size: memory grows almost linearly with it, so each next probe is
    interpolated between the nearest batches that fit and do not fit, which needs a handful
    of traced steps rather than a bisection's dozen."""
    started = time.perf_counter()
    probes: list[tuple[int, int, bool]] = []
    results: dict[int, Estimate] = {}
    limit = capacity * (1.0 - margin)

    def probe(batch: int) -> Estimate:
        result = estimate_workload(
            workload, setup.with_(batch_size=batch), target, margin, fallback, capacity
        )
        results[batch] = result
        probes.append((batch, result.headline_bytes, bool(result.fits)))
        if on_probe is not None:
            on_probe(result)
        return result

    first = probe(1)
    if not first.fits:
        found = alternatives(
            workload, setup.with_(batch_size=1), target, margin, fallback, capacity, on_probe
        )
        return MaxBatch(0, first, probes, capacity, found, time.perf_counter() - started)

    lo, hi = 1, None
    batch = 2
    while True:
        if probe(batch).fits:
            lo = batch
        else:
            hi = batch
        if hi is not None and hi - lo <= 1:
            break
        if hi is None and lo >= MAX_BATCH:
            break
        batch = _next_guess(lo, hi, results, limit)
    best = results[lo]
    return MaxBatch(lo, best, probes, capacity, [], time.perf_counter() - started)


def _next_guess(lo: int, hi: int | None, results: dict[int, Estimate], limit: float) -> int:
    lo_bytes = results[lo].headline_bytes
    other = hi if hi is not None else max((b for b in results if b < lo), default=None)
    guess: float
    if other is not None and other != lo:
        slope = (results[other].headline_bytes - lo_bytes) / (other - lo)
        guess = lo + (limit - lo_bytes) / slope if slope > 0 else lo * 2
    else:
        guess = lo * 2
    if hi is None:
        return int(min(max(guess, lo + 1), lo * _MAX_GROWTH, MAX_BATCH))
    nearest = int(guess)
    # Interpolation can crawl from one side when memory is not linear: bisect then.
    if not lo < nearest < hi or (hi - lo) > 8 and min(nearest - lo, hi - nearest) < (hi - lo) // 8:
        nearest = (lo + hi) // 2
    return nearest
