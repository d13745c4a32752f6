"""What ends a step: the optimizer step when there is one, else each top-level backward().

Real loops as research code writes them (tests/instrument/jobs/manual_loop_job.py) under the
real collector and writer.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_td
from tests.instrument.runjob import JOBS, PY, run_job
from torchdoctor.instrument.agent import BACKWARD_STEPS_TO_DECIDE
from torchdoctor.recording.steps import decode_json, step_stats

JOB = str(JOBS / "manual_loop_job.py")


def _boundary(run) -> list[str]:
    return [decode_json(r["value"]) for r in run.rows["settings"] if r["key"] == "steps.boundary"]


@pytest.mark.parametrize("mode", ["manual", "autograd"])
def test_loop_without_optimizer_or_dataloader_steps_at_backward(tmp_path, mode):
    run = run_job([PY, JOB, "--mode", mode, "--batches", "100"], tmp_path / "r.sqlite")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "updates 100"
    steps = run.rows["steps"]
    assert [s["step"] for s in steps] == list(range(100))  # one step per backward pass
    assert _boundary(run) == ["backward"]
    assert all(s["data_wait_s"] == 0 for s in steps)  # no DataLoader to wait on
    assert all(s["wall_s"] > 0 for s in steps)
    stats = step_stats(steps, run.rows["dataloaders"], run.rows["settings"])
    assert stats.boundary == "backward"
    # The steps follow each other: their walls add up to the time between first and last.
    span = steps[-1]["t_end"] - steps[0]["t_end"]
    walls = sum(s["wall_s"] for s in steps[1:])
    assert walls == pytest.approx(span, rel=0.05, abs=0.005)
    show = run_td("show", str(tmp_path / "r.sqlite"))
    assert show.returncode == 0, show.stderr
    assert "steps: 100," in show.stdout
    assert "no optimizer step seen: each backward() ends a step" in show.stdout


def test_short_manual_loop_is_recorded_at_exit(tmp_path):
    # Fewer backward passes than the agent waits for before deciding: recorded at exit.
    n = BACKWARD_STEPS_TO_DECIDE // 4
    run = run_job([PY, JOB, "--mode", "manual", "--batches", str(n)], tmp_path / "r.sqlite")
    assert run.returncode == 0, run.stderr
    assert len(run.rows["steps"]) == n
    assert _boundary(run) == ["backward"]


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    run = run_job(
        [PY, JOB, "--mode", "accumulate", "--batches", "120", "--accumulate", "4"],
        tmp_path / "r.sqlite",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "updates 30"
    steps = run.rows["steps"]
    assert len(steps) == 30  # 4 backward passes per optimizer step: 30 steps, not 120
    assert _boundary(run) == ["optimizer"]
    assert all(s["samples"] == 4 * 16 for s in steps)  # each step took its 4 micro-batches
    stats = step_stats(steps, run.rows["dataloaders"], run.rows["settings"])
    assert stats.boundary == "optimizer"
