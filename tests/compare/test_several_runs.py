"""Several runs a side: Student's t as tables give it, Welch's interval holding its 95 %, and
why it is there - runs of the same command that differ *between* them by a few percent (a
shared machine) make one run a side call equal runs different, and several runs a side do not."""

from __future__ import annotations

import math
import random

import pytest

from tests.compare.test_stats import figures, steps
from torchdoctor.compare.stats import (
    runs_step_ratio,
    student_t_cdf,
    student_t_quantile,
    typical_step,
    welch_interval,
)
from torchdoctor.compare.verdict import (
    BY_RUNS,
    NO_CHANGE,
    RUNS_BAND,
    SLOWER,
    compare,
    compare_runs,
)
from torchdoctor.errors import UserError


@pytest.mark.parametrize(
    "df, t975",
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (8, 2.306), (30, 2.042), (1e6, 1.960)],
)
def test_student_t_quantiles_are_the_tables(df, t975):
    assert student_t_quantile(0.975, df) == pytest.approx(t975, abs=1e-3)
    assert student_t_quantile(0.025, df) == pytest.approx(-t975, abs=1e-3)
    assert student_t_cdf(student_t_quantile(0.9, df), df) == pytest.approx(0.9, abs=1e-9)


def test_welch_interval_holds_the_true_difference_95_times_in_100():
    rng = random.Random(7)
    held = 0
    trials = 2000
    for _ in range(trials):
        # Five runs a side whose spreads differ (a change can change the spread: Welch's
        # case). With 3 runs against 4 and spreads 4:1 it holds about 93 %: with so few runs
        # Welch's degrees of freedom are an approximation, a little generous.
        a = [rng.gauss(1.0, 0.04) for _ in range(5)]
        b = [rng.gauss(1.1, 0.02) for _ in range(5)]
        held += welch_interval(a, b).contains(0.1)
    assert 0.935 <= held / trials <= 0.975


def test_welch_interval_refuses_one_value_a_side_and_is_exact_without_spread():
    with pytest.raises(ValueError):
        welch_interval([1.0], [1.0, 2.0])
    iv = welch_interval([1.0, 1.0], [1.5, 1.5])
    assert (iv.estimate, iv.low, iv.high) == (0.5, 0.5, 0.5)


def run_steps(rng: random.Random, median_s: float, between: float, seed: int) -> list[float]:
    """One run's steps: the run's own level drawn with ``between`` (log s.d.) around
    ``median_s`` - the spread between runs of the same command - then its step noise."""
    return steps(60, median_s * math.exp(rng.gauss(0, between)), seed)


def test_spread_between_runs_fools_one_run_a_side_but_not_several():
    # Runs of one command whose levels differ by 4 % (one s.d.), as on a shared 2-CPU VM.
    rng = random.Random(43)
    pairs = 100
    one_wrong = several_wrong = 0
    for i in range(pairs):
        a = [run_steps(rng, 0.02, 0.04, 1000 * i + k) for k in range(5)]
        b = [run_steps(rng, 0.02, 0.04, 1000 * i + 500 + k) for k in range(5)]
        one = compare(_with_steps(figures(seed=1), a[0]), _with_steps(figures(seed=2), b[0]))
        one_wrong += one.verdict != NO_CHANGE
        several = compare_runs(
            [_with_steps(figures(seed=k), s) for k, s in enumerate(a)],
            [_with_steps(figures(seed=10 + k), s) for k, s in enumerate(b)],
        )
        assert several.method == BY_RUNS and several.band == RUNS_BAND
        several_wrong += several.verdict != NO_CHANGE
    # One run a side: its interval sees only the steps, so runs 4 % apart are "different" in
    # a large share of pairs; five a side hold the 95 %.
    assert one_wrong >= 25, one_wrong
    assert several_wrong <= 7, several_wrong


def test_five_runs_a_side_detect_a_ten_percent_slowdown_on_that_spread():
    rng = random.Random(46)
    hits = 0
    for i in range(40):
        a = [run_steps(rng, 0.02, 0.04, 2000 * i + k) for k in range(5)]
        b = [run_steps(rng, 0.022, 0.04, 2000 * i + 500 + k) for k in range(5)]
        c = compare_runs(
            [_with_steps(figures(seed=k), s) for k, s in enumerate(a)],
            [_with_steps(figures(seed=10 + k), s) for k, s in enumerate(b)],
        )
        hits += c.verdict == SLOWER
        assert c.ratio.low < c.ratio.estimate < c.ratio.high
    assert hits >= 30, hits


def test_the_ratio_is_that_of_the_geometric_means_of_the_runs():
    r = runs_step_ratio([1.0, 4.0], [2.0, 8.0])
    assert r.estimate == pytest.approx(2.0)
    assert r.low < 2.0 < r.high
    assert math.isnan(runs_step_ratio([0.0, 1.0], [1.0, 1.0]).estimate)


def test_sides_name_their_runs_and_keep_their_worst_memory():
    a = [figures(seed=1), figures(seed=2, peak_rss=3 * 2**30)]
    b = [figures(seed=3), figures(seed=4, batch_size=64)]
    with pytest.raises(UserError, match="B2: batch size 32 vs 64"):
        compare_runs(a, b)
    b[1] = figures(seed=4, settings={"dataloader.num_workers": 2, "torch.num_threads": 4})
    c = compare_runs(a, b)
    assert c.a_runs == ["run1.sqlite", "run2.sqlite"] and c.b_runs == ["run3.sqlite", "run4.sqlite"]
    assert c.a_peak_rss == 3 * 2**30 and c.b_peak_rss == 2**30
    assert "B's runs differ among themselves in dataloader.num_workers" in c.notes
    assert c.a_steps == 120
    typical = [typical_step(run.series["step"]) for run in a]
    assert c.phases[0].a_per_step_s == pytest.approx(sum(typical) / 2)
    with pytest.raises(UserError, match="each side needs at least 2"):
        compare_runs(a[:1], b)


def _with_steps(run, walls):
    run.series = {"step": walls, "data_wait": [0.0] * len(walls), "compute": list(walls)}
    run.steady_steps = len(walls)
    return run


def test_a_small_change_called_from_one_run_a_side_says_to_record_several():
    a = figures(seed=1)
    small = compare(a, figures(seed=2, step=0.0216, wait=0.0194))
    assert small.verdict == SLOWER
    assert any(
        n.startswith("one run a side: ") and "A1 A2 A3 vs B1 B2 B3" in n for n in small.notes
    )
    big = compare(a, figures(seed=2, step=0.04, wait=0.038))
    assert big.verdict == SLOWER and not any(n.startswith("one run a side") for n in big.notes)
    several = compare_runs([figures(seed=1), figures(seed=3)], [figures(seed=2, step=0.0216)] * 2)
    assert not any(n.startswith("one run a side") for n in several.notes)
