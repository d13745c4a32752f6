"""Throughput from a trial's steps (warm-up left out, the slowest rank sets the pace) and its
memory peak."""

from __future__ import annotations

import sqlite3
from collections import defaultdict

import pytest

from tests.diagnosis.builders import GiB, Job, Proc
from torchdoctor.recording.reader import open_recording
from torchdoctor.recording.steps import warmup_steps
from torchdoctor.tune.measure import memory_peak, step_window, trial_warmup
from torchdoctor.tune.space import Config


def steps(pid: int, walls: list[float], wait: float = 0.0, samples: int | None = 8):
    rows, t = [], 1000.0
    for i, wall in enumerate(walls):
        rows.append(
            {
                "pid": pid,
                "step": i,
                "t_start": t,
                "t_end": t + wall,
                "wall_s": wall,
                "data_wait_s": wait * wall,
                "samples": samples,
            }
        )
        t += wall
    return rows


def test_warmup_covers_worker_start_up_and_their_first_batches():
    assert trial_warmup(Config(0, 1)) == 5
    assert trial_warmup(Config(8, 1, 2)) == 10


def test_one_warmup_rule_for_trials_and_recordings():
    # Read afterwards, a recording leaves out at most a tenth of a short run, the whole
    # warm-up of a long one: the same warm-up a trial asks for beforehand.
    assert [warmup_steps(n) for n in (0, 1, 2, 19, 30, 1000)] == [0, 0, 1, 1, 3, 5]
    assert warmup_steps(1000, workers=8) == trial_warmup(Config(8, 1, 2)) == 10
    assert warmup_steps(40, workers=8) == 4


def test_worker_start_up_is_left_out_of_the_throughput():
    # A 3 s first step (workers starting) then 20 steps of 0.1 s.
    w = step_window(steps(1, [3.0] + [0.1] * 24, wait=0.5), warmup=5)
    assert w.steps == 20
    assert w.steps_per_s == pytest.approx(10.0)
    assert w.samples_per_s == pytest.approx(80.0)
    assert w.data_wait_share == pytest.approx(0.5)
    assert w.spread == pytest.approx(0.0, abs=1e-9)


def test_slowest_rank_sets_the_pace_and_unknown_samples_stay_unknown():
    fast = steps(1, [0.1] * 30)
    slow = steps(2, [0.2] * 30, samples=None)
    w = step_window(fast + slow, warmup=5)
    assert w.steps_per_s == pytest.approx(5.0)
    assert w.samples_per_s is None


def test_too_few_steps_give_no_measurement():
    assert step_window(steps(1, [0.1] * 6), warmup=5) is None
    assert step_window([], warmup=5) is None


def test_memory_peak_sums_each_instant_pss_first_in_sql(tmp_path):
    job = Job(
        duration=60.0,
        procs=[
            Proc(1000, rss=lambda t: 1 * GiB + (t % 17) * 1e7),
            Proc(1001, role="dataloader-worker", rss=lambda t: 0.5 * GiB + (t % 5) * 1e7),
        ],
    )
    path = job.write(tmp_path / "trial.sqlite")
    with sqlite3.connect(path) as db:  # the worker's shared pages split: PSS below RSS
        db.execute("UPDATE process_samples SET pss = rss / 3 WHERE pid = 1001")
    with open_recording(path) as rec:
        held = defaultdict(int)  # the reference: every row as a dict
        for r in rec.rows("process_samples", columns=["t", "pss", "rss"]):
            held[r["t"]] += r["pss"] if r["pss"] is not None else r["rss"]
        assert memory_peak(rec) == max(held.values())
        assert memory_peak(rec) < max(
            r["v"] for r in rec.query("SELECT SUM(rss) AS v FROM process_samples GROUP BY t")
        )  # PSS was taken where known
