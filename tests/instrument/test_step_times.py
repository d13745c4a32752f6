"""The steps the agent records against a loop whose step times are known and measured by the
loop itself (tests/instrument/jobs/known_steps_job.py), under the real collector and writer:
the same steps, in order, with the same wall time, data wait, samples and end time."""

from __future__ import annotations

import json

import pytest

from tests.instrument.runjob import JOBS, PY, run_job

pytest.importorskip("torch")
JOB = str(JOBS / "known_steps_job.py")
# The loop's own clock reads sit next to the agent's (the step hook runs at the end of
# optimizer.step()); a busy machine may preempt either side briefly. The first step also does
# one-off work after the agent's clock read (the settings it captures: 3.4 ms seen on a loaded
# 2-core machine), which the loop's own clock holds and the recorded end rightly does not:
# there the recorded end may come before the loop's by FIRST_STEP_SLACK_S, never after it, and
# the second step's recorded wall time (from that end) may be as much longer.
SLACK_S = 0.003
FIRST_STEP_SLACK_S = 0.010


def test_recorded_steps_match_the_loops_own_measurements(tmp_path):
    measured_path = tmp_path / "measured.json"
    run = run_job([PY, JOB, str(measured_path)], tmp_path / "r.sqlite")
    assert run.returncode == 0, run.stderr
    measured = json.loads(measured_path.read_text())
    steps = sorted(run.rows["steps"], key=lambda r: r["step"])
    assert [s["step"] for s in steps] == list(range(len(measured)))
    for step, mine in zip(steps, measured, strict=True):
        where = f"step {step['step']}: recorded {step}, measured {mine}"
        assert step["data_wait_s"] == pytest.approx(mine["wait"], abs=SLACK_S), where
        assert step["samples"] == mine["n"] and step["batch_size"] == mine["n"], where
        if step["step"] == 0:
            low, high = mine["t_end"] - FIRST_STEP_SLACK_S, mine["t_end"] + SLACK_S
            assert low <= step["t_end"] <= high, where
            continue  # the first step starts at its first batch, the loop's earlier
        assert step["t_end"] == pytest.approx(mine["t_end"], abs=SLACK_S), where
        if step["step"] == 1:
            low, high = mine["wall"] - SLACK_S, mine["wall"] + FIRST_STEP_SLACK_S
            assert low <= step["wall_s"] <= high, where
        else:
            assert step["wall_s"] == pytest.approx(mine["wall"], abs=SLACK_S), where
    # Consecutive steps follow each other on the recorded clock too.
    for before, after in zip(steps, steps[1:], strict=False):
        assert after["t_start"] == pytest.approx(before["t_end"], abs=1e-4)
