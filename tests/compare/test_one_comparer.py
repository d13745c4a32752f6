"""One comparer: tune's verified gain is compare's figure. A search whose trials keep their step
times reports as its gain exactly ``compare.stats.speedup`` over the verification's steps (the
inverse of the ratio ``torchdoctor compare`` prints), with the same interval."""

from __future__ import annotations

import random

from torchdoctor.compare.stats import speedup, step_ratio
from torchdoctor.tune.result import OK, Measurement
from torchdoctor.tune.search import Search
from torchdoctor.tune.space import Config, Space

ORIGINAL = Config(num_workers=0, num_threads=2)


def step_time(c: Config) -> float:
    """A data-bound job on 2 CPUs: workers make its 12 ms batches in parallel."""
    return 0.004 + 0.012 / (1 + min(c.num_workers, 2))


class StepsMeasure:
    """Trials that record 60 step times each, noisy, as a real trial's steps table does."""

    def __init__(self) -> None:
        self.rng = random.Random(3)
        self.now = 0.0
        self.log: list[Measurement] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, config: Config, purpose: str, deadline: float | None) -> Measurement:
        self.now += 5.0
        steps = [step_time(config) * (1 + self.rng.gauss(0, 0.03)) for _ in range(60)]
        m = Measurement(
            len(self.log),
            config,
            purpose,
            OK,
            throughput=len(steps) / sum(steps),
            steps=len(steps),
            duration_s=5.0,
            step_s=steps,
        )
        self.log.append(m)
        return m


def test_tune_gain_is_compares_speedup_over_the_verification_steps() -> None:
    measure = StepsMeasure()
    space = Space.for_machine(2, include=ORIGINAL)
    result = Search(space, measure, ORIGINAL, clock=measure.clock).run()
    v = result.verification
    assert v is not None and v.confirmed and v.interval is not None
    a = [s for m in result.trials if m.purpose == "verify-original" for s in m.step_s]
    b = [s for m in result.trials if m.purpose == "verify-tuned" for s in m.step_s]
    expected = speedup(a, b)
    assert result.gain == expected.estimate
    assert (v.interval.low, v.interval.high) == (expected.low, expected.high)
    assert v.interval.low <= result.gain <= v.interval.high
    # And it is compare's ratio turned over: B's step time over A's is its inverse.
    ratio = step_ratio(a, b)
    assert abs(ratio.estimate * result.gain - 1) < 1e-12
    assert abs(ratio.high * v.interval.low - 1) < 1e-12
    assert result.to_json()["verification"]["gain_low"] == v.interval.low


def test_speedup_of_equal_runs_holds_one() -> None:
    rng = random.Random(5)
    a = [0.02 * (1 + rng.gauss(0, 0.05)) for _ in range(200)]
    b = [0.02 * (1 + rng.gauss(0, 0.05)) for _ in range(200)]
    s = speedup(a, b)
    assert s.low < 1 < s.high
