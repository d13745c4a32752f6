"""The statistics of compare on synthetic step times: a known ratio lies inside its interval,
equal runs give no change, the same input gives the same interval, and the verdict's rules."""

from __future__ import annotations

import math
import random

import pytest

from torchdoctor.compare.runs import COMPUTE, DATA_WAIT, STEP, RunFigures
from torchdoctor.compare.stats import (
    Interval,
    PairedSeries,
    block_length,
    bootstrap,
    typical_step,
    winsorized,
)
from torchdoctor.compare.verdict import (
    FASTER,
    NO_CHANGE,
    SLOWER,
    compare,
    verdict_of,
)
from torchdoctor.errors import UserError


def steps(
    n: int, median_s: float, seed: int, *, drift: float = 0.0, outliers: float = 0.01
) -> list[float]:
    """Step times around ``median_s``: log-normal noise, rare outliers (1 %: a checkpoint, a
    garbage collection), and with ``drift`` an AR(1) wander from one step to the next, as a
    machine's load makes. (Slow steps every few steps are not outliers but the job's pace: a
    DataLoader's bursts; the block means count them in.)"""
    rng = random.Random(seed)
    out, level = [], 0.0
    for _ in range(n):
        level = drift * level + rng.gauss(0, 0.02)
        t = median_s * math.exp(level + rng.gauss(0, 0.03))
        if rng.random() < outliers:
            t *= 8  # an outlier the median must not follow
        out.append(t)
    return out


def ratio_of(a: list[float], b: list[float]) -> Interval:
    ratio, _ = bootstrap(PairedSeries({STEP: a}, {STEP: b}), STEP, resamples=400)
    return ratio


@pytest.mark.parametrize("factor", [0.5, 0.9, 1.1, 1.25])
def test_a_known_ratio_lies_inside_its_interval(factor):
    a = steps(300, 0.020, seed=1)
    b = steps(300, 0.020 * factor, seed=2)
    ratio = ratio_of(a, b)
    assert ratio.low <= factor <= ratio.high, (factor, ratio)
    assert ratio.low < ratio.estimate < ratio.high
    assert verdict_of(ratio) == (FASTER if factor < 1 else SLOWER)


def test_one_huge_outlier_does_not_move_the_figure():
    a = steps(200, 0.02, 5, outliers=0)
    b = list(a)
    b[100] = 60.0  # a checkpoint of a minute
    b[150] = 0.4
    ratio = ratio_of(a, b)
    assert ratio.estimate < 1.01 and verdict_of(ratio) == NO_CHANGE


def test_runs_from_one_distribution_are_no_change():
    for seed in range(5):
        ratio = ratio_of(steps(200, 0.02, seed), steps(200, 0.02, seed + 100))
        assert verdict_of(ratio) == NO_CHANGE, (seed, ratio)
    same = steps(100, 0.02, 7)
    ratio = ratio_of(same, list(same))
    assert ratio.estimate == 1.0 and ratio.contains(1.0)


def test_the_interval_is_reproducible_and_wider_for_wandering_steps():
    a, b = steps(300, 0.02, 3, drift=0.9), steps(300, 0.02, 4, drift=0.9)
    assert ratio_of(a, b) == ratio_of(a, b)  # seeded: the same recordings, the same interval
    wander = ratio_of(a, b)
    still = ratio_of(steps(300, 0.02, 3), steps(300, 0.02, 4))
    assert wander.high - wander.low > still.high - still.low


def test_every_phase_gets_a_difference_with_its_interval():
    a = {STEP: [0.02] * 50, DATA_WAIT: [0.015] * 50}
    b = {STEP: [0.01] * 50, DATA_WAIT: [0.005] * 50}
    ratio, deltas = bootstrap(PairedSeries(a, b), STEP, resamples=50)
    assert ratio == Interval(0.5, 0.5, 0.5)
    assert deltas[DATA_WAIT].estimate == pytest.approx(-0.01)
    # a phase A never spent time in has no ratio, only a difference
    ratio, _ = bootstrap(PairedSeries({STEP: [0.0] * 20}, {STEP: [0.01] * 20}), STEP)
    assert math.isnan(ratio.estimate)


def test_blocks():
    assert block_length(1) == 1 and block_length(10) == 4 and block_length(8100) == 90
    # two workers: every other step waits a whole sample; the figure is the throughput
    assert typical_step([0.02, 0.0] * 50) == pytest.approx(0.01)
    # the slowest 2 % are capped at the 98th percentile: one step of 100 s in 100 is not the pace
    assert typical_step([1.0] * 99 + [100.0]) == 1.0
    assert winsorized([float(i) for i in range(101)])[-3:] == [98.0, 98.0, 98.0]


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [
        (0.95, 1.05, NO_CHANGE),  # holds 1
        (1.005, 1.02, NO_CHANGE),  # excludes 1 but within the band: too small to matter
        (1.01, 1.08, NO_CHANGE),  # reaches into the band: not a change beyond it for sure
        (1.04, 1.10, SLOWER),
        (0.40, 0.60, FASTER),
        (math.nan, math.nan, NO_CHANGE),
    ],
)
def test_verdict_rules(low, high, verdict):
    assert verdict_of(Interval((low + high) / 2, low, high)) == verdict


def figures(**kw) -> RunFigures:
    n = kw.pop("n", 60)
    step = kw.pop("step", 0.02)
    wait = kw.pop("wait", 0.018)
    seed = kw.pop("seed", 1)
    walls = steps(n, step, seed)
    waits = [w * wait / step for w in walls]
    base = dict(
        path=f"run{seed}.sqlite",
        command=["python", "train.py"],
        workload="train.py",
        batch_size=32,
        params_count=1000,
        step_count=n + 5,
        steady_steps=n,
        warmup_rule="first steps",
        series={
            STEP: walls,
            DATA_WAIT: waits,
            COMPUTE: [w - d for w, d in zip(walls, waits, strict=True)],
        },
        settings={"dataloader.num_workers": 0, "torch.num_threads": 4},
        environment={"torch": "2.13.0"},
        peak_rss=2**30,
        peak_pss=2**29,
        peak_vram=None,
        host_cpu_busy_pct=40.0,
        job_cpus=1.0,
        other_cpus=0.2,
    )
    base.update(kw)
    return RunFigures(**base)


def test_compare_names_the_setting_behind_the_phase_that_moved():
    a = figures()
    b = figures(
        seed=2,
        step=0.008,
        wait=0.006,
        settings={"dataloader.num_workers": 4, "torch.num_threads": 4},
    )
    c = compare(a, b, ["data-loader-bound"], [])
    assert c.verdict == FASTER
    moved = {p.phase for p in c.phases if p.moved}
    assert DATA_WAIT in moved and COMPUTE not in moved
    assert any(
        "data wait fell" in e and "dataloader.num_workers 0 -> 4" in e for e in c.explanations
    )
    assert c.findings_disappeared == ["data-loader-bound"] and c.findings_appeared == []


def test_compare_says_the_machine_was_busier_when_no_setting_changed():
    a = figures()
    b = figures(seed=2, step=0.03, wait=0.028, other_cpus=1.5)
    c = compare(a, b)
    assert c.verdict == SLOWER and c.busier and not c.settings
    assert any("no setting changed, but the machine was busier" in e for e in c.explanations)


def test_a_run_on_saturated_cpus_is_named_first_among_the_reasons():
    # Other programs held 1.3 CPUs while the CPUs were 97 % busy during B: the verdict stands,
    # and the first reason says the machine, not the job, may have made the difference.
    a = figures()
    b = figures(seed=2, step=0.03, wait=0.028, other_cpus=1.3, host_cpu_busy_pct=97.0)
    c = compare(a, b)
    assert c.verdict == SLOWER and c.contended == ["B"]
    assert c.explanations[0] == (
        "during B the CPUs were 97 % busy and other programs used 1.3 of them: a step that "
        "computes moves with them"
    )
    # the job's own load on busy CPUs is no contention
    own = figures(seed=2, step=0.03, wait=0.028, other_cpus=0.2, host_cpu_busy_pct=97.0)
    assert compare(a, own).contended == []


def test_where_the_job_measured_its_wait_for_a_cpu_that_decides():
    # Measured on this VM: on CPUs saturated by two hogs a compute loop's main thread waited
    # for a CPU 72 % of its steady steps, a loop that sleeps for its data 4.5 %.
    a = figures()
    saturated = {"other_cpus": 1.8, "host_cpu_busy_pct": 100.0}
    starved = figures(seed=2, step=0.03, wait=0.001, run_queue_wait=0.72, **saturated)
    c = compare(a, starved)
    assert c.contended == ["B"]
    assert c.explanations[0] == (
        "during B the job waited for a CPU 72 % of its time while other programs used 1.8 "
        "CPUs: a step that computes moves with them"
    )
    sleeping = figures(seed=2, run_queue_wait=0.045, **saturated)
    assert compare(a, sleeping).contended == []
    # its own threads outnumbering the CPUs: it waits, but not for other programs
    crowded = figures(seed=2, run_queue_wait=0.5, other_cpus=0.1, host_cpu_busy_pct=100.0)
    assert compare(a, crowded).contended == []


def test_unlike_workloads_and_short_runs_are_refused_in_one_line():
    a = figures()
    with pytest.raises(UserError) as refused:
        compare(a, figures(seed=2, batch_size=64, workload="other.py"))
    message = refused.value.message
    assert "\n" not in message and "batch size 32 vs 64" in message and "other.py" in message
    forced = compare(a, figures(seed=2, batch_size=64), force=True)
    assert forced.mismatch == ["batch size 32 vs 64"]
    with pytest.raises(UserError, match="has 15 steady steps"):
        compare(a, figures(seed=2, n=15))
