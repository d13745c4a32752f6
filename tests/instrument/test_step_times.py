"""The steps the agent records against a loop whose step times are known and measured by the
loop itself (tests/instrument/jobs/known_steps_job.py), under the real collector and writer:
the same steps, in order, with the same wall time, data wait, samples and end time."""

from __future__ import annotations

import json

import pytest

from tests.helpers.dependencies import require
from tests.instrument.runjob import JOBS, PY, run_job

require("torch")
JOB = str(JOBS / "known_steps_job.py")
# The loop's own clock reads sit next to the agent's (the step hook runs at the end of
# optimizer.step()); a busy machine may preempt either side briefly (SLACK_S). The agent may
# also work in its hook after its clock read: the settings it captures at the first step, a
# flush every 0.5 s (3.1-3.4 ms each seen on a loaded 2-core machine). The loop's clock holds
# that time and the recorded end rightly does not: a recorded end may come before the loop's by
# up to AGENT_WORK_S, never after it, and each recorded wall time is the loop's shifted by what
# the agent did in this step's hook and in the last one (the recorded steps' ends).
SLACK_S = 0.003
AGENT_WORK_S = 0.010


def test_recorded_steps_match_the_loops_own_measurements(tmp_path):
    measured_path = tmp_path / "measured.json"
    run = run_job([PY, JOB, str(measured_path)], tmp_path / "r.sqlite")
    assert run.returncode == 0, run.stderr
    measured = json.loads(measured_path.read_text())
    steps = sorted(run.rows["steps"], key=lambda r: r["step"])
    assert [s["step"] for s in steps] == list(range(len(measured)))
    lag_before = None
    for step, mine in zip(steps, measured, strict=True):
        where = f"step {step['step']}: recorded {step}, measured {mine}"
        assert step["data_wait_s"] == pytest.approx(mine["wait"], abs=SLACK_S), where
        assert step["samples"] == mine["n"] and step["batch_size"] == mine["n"], where
        lag = mine["t_end"] - step["t_end"]  # the agent's own work after its clock read
        assert -SLACK_S <= lag <= AGENT_WORK_S, where
        if lag_before is not None:  # the first step starts at its first batch, the loop's earlier
            expected = mine["wall"] - lag + lag_before
            assert step["wall_s"] == pytest.approx(expected, abs=SLACK_S), where
        lag_before = lag
    # Consecutive steps follow each other on the recorded clock too.
    for before, after in zip(steps, steps[1:], strict=False):
        assert after["t_start"] == pytest.approx(before["t_end"], abs=1e-4)
