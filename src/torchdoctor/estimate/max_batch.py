"""The largest batch that fits, found by searching over simulated steps (no GPU, no OOM)."""

from __future__ import annotations

import time
from collections.abc import Callable

from torchdoctor.estimate.fitcheck import FitCheck, alternatives
from torchdoctor.estimate.result import Estimate, MaxBatch
from torchdoctor.estimate.setup import TrainingSetup

MAX_BATCH = 1 << 20
_MAX_GROWTH = 1024


def find_max_batch(
    check: FitCheck,
    setup: TrainingSetup,
    on_probe: Callable[[int, int, bool], None] | None = None,
) -> MaxBatch:
    """Search the batch size: memory grows almost linearly with it, so each next probe is
    interpolated between the nearest batches that fit and do not fit, which needs a handful
    of traced steps rather than a bisection's dozen. ``on_probe(batch, bytes, fits)`` hears
    of each probe as it ends (for a progress line)."""
    started = time.perf_counter()
    probes: list[tuple[int, int, bool]] = []
    results: dict[int, Estimate] = {}
    capacity = check.capacity
    assert capacity is not None, "a batch search needs a memory to fit"
    limit = capacity * (1.0 - check.margin)

    def at(batch: int) -> Estimate:
        result = check.estimate(setup.with_(batch_size=batch))
        results[batch] = result
        probes.append((batch, result.headline_bytes, bool(result.fits)))
        if on_probe is not None:
            on_probe(batch, result.headline_bytes, bool(result.fits))
        return result

    first = at(1)
    if not first.fits:
        found = alternatives(check, setup.with_(batch_size=1))
        return MaxBatch(0, first, probes, capacity, found, time.perf_counter() - started)

    lo, hi = 1, None
    batch = 2
    stalls = 0
    while True:
        width = (hi - lo) if hi is not None else None
        if at(batch).fits:
            lo = batch
        else:
            hi = batch
        if hi is not None and hi - lo <= 1:
            break
        if hi is None and lo >= MAX_BATCH:
            break
        # Interpolation can crawl from one side when memory is not linear in the batch: after
        # three probes that did not halve the bracket, bisect once.
        stalls = stalls + 1 if width is not None and hi is not None and (hi - lo) * 2 > width else 0
        if stalls >= 3:
            stalls = 0
            batch = (lo + hi) // 2 if hi is not None else lo * 2
        else:
            batch = _next_guess(lo, hi, results, limit)
    best = results[lo]
    return MaxBatch(lo, best, probes, capacity, [], time.perf_counter() - started)


def _next_guess(lo: int, hi: int | None, results: dict[int, Estimate], limit: float) -> int:
    """Where the line through the nearest probes crosses the limit."""
    lo_bytes = results[lo].headline_bytes
    other = hi if hi is not None else max((b for b in results if b < lo), default=None)
    guess = float(lo * 2)
    if other is not None and other != lo:
        slope = (results[other].headline_bytes - lo_bytes) / (other - lo)
        if slope > 0:
            guess = lo + (limit - lo_bytes) / slope
    if hi is None:
        return int(min(max(guess, lo + 1), lo * _MAX_GROWTH, MAX_BATCH))
    return min(max(int(guess), lo + 1), hi - 1)
