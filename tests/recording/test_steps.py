"""step_stats over hand-made rows shaped like the recording's."""

from __future__ import annotations

import json
import math

import pytest

from torchdoctor.recording.steps import (
    quantile,
    step_samples,
    step_stats,
    step_wait_s,
    warmup_steps,
)


def _steps(pid, rank, n, wall, wait, batch=None, first_wall=5.0):
    rows, t = [], 100.0
    for i in range(n):
        w = first_wall if i == 0 else wall
        rows.append(
            {
                "pid": pid,
                "rank": rank,
                "step": i,
                "t_start": t,
                "t_end": t + w,
                "wall_s": w,
                "data_wait_s": wait if i else w,
                "batch_size": batch,
                "samples": batch,
            }
        )
        t += w
    return rows


def test_warmup_rule():
    assert [warmup_steps(n) for n in (0, 1, 2, 9, 10, 30, 100)] == [0, 0, 1, 1, 1, 3, 5]


def test_single_trainer_figures_exclude_warmup():
    rows = _steps(7, None, 21, wall=0.1, wait=0.025, batch=32)
    settings = [{"pid": 7, "rank": None, "t": 1.0, "key": "torch.num_threads", "value": "4"}]
    loaders = [{"pid": 7, "rank": None, "loader_id": 0, "batch_size": 32, "pin_memory": 1}]
    s = step_stats(rows, loaders, settings)
    assert s.step_count == 21 and s.measured_steps == 19  # 21 // 10 = 2 warm-up steps
    assert s.median_step_s == pytest.approx(0.1) and s.p90_step_s == pytest.approx(0.1)
    assert s.data_wait_fraction == pytest.approx(0.25)
    assert s.steps_per_s == pytest.approx(10.0)
    assert s.samples_per_s == pytest.approx(320.0)
    assert s.batch_size == 32 and s.settings == {"torch.num_threads": 4}
    assert s.dataloaders == [{"pid": 7, "loader_id": 0, "batch_size": 32, "pin_memory": True}]
    json.dumps(s.to_dict())


def test_two_ranks_add_samples_and_average_steps():
    rows = _steps(1, 0, 11, 0.2, 0.0, batch=8) + _steps(2, 1, 11, 0.1, 0.05, batch=8)
    s = step_stats(rows, [], [])
    assert [r.rank for r in s.per_rank] == [0, 1]
    assert s.per_rank[0].steps_per_s == pytest.approx(5.0)
    assert s.per_rank[1].data_wait_fraction == pytest.approx(0.5)
    assert s.steps_per_s == pytest.approx(7.5)
    assert s.samples_per_s == pytest.approx(40 + 80)
    assert s.p90_step_s == pytest.approx(0.2)


def test_unknown_batch_size_gives_no_samples_per_second():
    s = step_stats(_steps(1, None, 5, 0.1, 0.0), [], [])
    assert s.samples_per_s is None and s.steps_per_s == pytest.approx(10.0)


def test_no_steps():
    s = step_stats([], [], [])
    assert s.step_count == 0 and s.median_step_s is None and s.data_wait_fraction is None


def test_a_step_waits_no_longer_than_it_lasted():
    rows = _steps(1, None, 12, wall=0.1, wait=0.3, batch=4)  # a wait measured across a boundary
    s = step_stats(rows, [], [])
    assert s.data_wait_fraction == pytest.approx(1.0)
    assert s.per_rank[0].data_wait_fraction == pytest.approx(1.0)
    assert s.mean_data_wait_s == pytest.approx(0.1) and s.p90_data_wait_s == pytest.approx(0.1)


def test_an_epochs_short_last_batch_keeps_the_batch_size_and_the_window():
    rows = _steps(1, None, 21, wall=0.1, wait=0.0, batch=32)
    rows[-1]["batch_size"] = rows[-1]["samples"] = 8
    s = step_stats(rows, [], [])
    assert s.batch_size == 32
    assert s.mean_step_s == pytest.approx(0.1)
    # the measured steps' span: from the first one after warm-up to the end of the last
    assert s.t_start == pytest.approx(rows[2]["t_start"]) and s.t_end == rows[-1]["t_end"]


def test_the_step_helpers():
    assert step_wait_s({"wall_s": 0.2, "data_wait_s": None}) == 0.0
    assert step_samples({"samples": None, "batch_size": 16}) == 16
    assert step_samples({"samples": None, "batch_size": None}, fallback=8) == 8
    assert step_samples({"samples": 3, "batch_size": 16}) == 3
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and math.isnan(quantile([], 0.9))
