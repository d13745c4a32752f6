"""A condition that holds for a whole run is sustained over the whole run, jitter or not."""

from __future__ import annotations

import random

from torchdoctor.diagnosis.series import sustained_span
from torchdoctor.thresholds import Thresholds


def _series(n: int, value: float, jitter: float, seed: int = 1) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append((t, value))
        t += 0.5 + rng.uniform(-jitter, jitter)
    return out


def test_span_covers_the_whole_run_despite_sampling_jitter() -> None:
    series = _series(1000, 95.0, jitter=0.02)
    span = sustained_span(series, 80.0, Thresholds())
    assert span is not None
    assert span.t_start == series[0][0] and span.t_end == series[-1][0]


def test_a_gap_in_the_samples_does_not_end_the_search() -> None:
    series = _series(200, 95.0, jitter=0.0)
    # the recorder stalled for 30 s after 20 s; the condition held before and after
    gap = [(t + 30.0, v) if t > 20.0 else (t, v) for t, v in series]
    span = sustained_span(gap, 80.0, Thresholds())
    assert span is not None and span.t_end == gap[-1][0]


def test_a_short_burst_is_not_sustained() -> None:
    series = [(t, 95.0 if 10.0 <= t < 13.0 else 20.0) for t, _ in _series(120, 0.0, 0.0)]
    assert sustained_span(series, 80.0, Thresholds()) is None
