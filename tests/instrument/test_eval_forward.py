"""Evaluation without a DataLoader (issue 48): a nanoGPT-shaped loop whose ``estimate_loss``
calls the model in eval mode under ``@torch.no_grad()`` on batches it cuts itself. Its time is
left out of the step it falls in and recorded as an ``evaluation`` event; a frozen teacher
called once per step under no_grad stays in the step. Real child processes under the real
collector, on the compiled and the pure-Python path (the block's time reaches the compiled
short path through ``eval_ns``, as a DataLoader evaluation's does).

Timing is compared within a run: the loop measures its own training steps (less the
evaluation) with ``time.perf_counter``, and the recording must agree with it within a fraction
of the evaluation's own length (each evaluation is several steps long: counted into its step
it could not pass), and the median step with and without evaluation must agree.
"""

from __future__ import annotations

import json
import statistics

import pytest

from tests.instrument.runjob import JOBS, PY, run_job
from torchdoctor.instrument.agent import compiled
from torchdoctor.instrument.agent.contract import ENV_PURE_PYTHON
from torchdoctor.recording.steps import evaluation_stats

JOB = str(JOBS / "nograd_eval_job.py")
STEPS, EVERY, PASSES, BATCH = 24, 6, 24, 8


def _run(tmp_path, mode: str, pure: bool):
    if not pure and compiled.fast is None:
        pytest.skip(f"no compiled path in this install ({compiled.FAST_PATH})")
    run = run_job(
        [PY, JOB, mode],
        tmp_path / f"{mode}.sqlite",
        env={ENV_PURE_PYTHON: "1"} if pure else None,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    own = json.loads(run.stdout)
    steps = sorted(run.rows["steps"], key=lambda r: r["step"])
    assert len(steps) == STEPS
    passes = [json.loads(e["detail"]) for e in run.events("evaluation")]
    return own, steps, passes, run


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure-python"])
def test_evaluation_without_a_dataloader_leaves_the_steps(tmp_path, pure):
    own, steps, passes, run = _run(tmp_path, "eval", pure)
    assert [p["step"] for p in passes] == list(range(EVERY - 1, STEPS, EVERY))
    for p, seconds in zip(passes, own["evaluations"], strict=True):
        assert p["detected_by"] == "forward-passes" and p["ended_by"] == "block-end"
        assert p["batches"] == PASSES and p["samples"] == PASSES * BATCH  # every pass counted
        assert abs(p["seconds"] - seconds) < 0.25 * seconds + 0.01, (p, seconds)
        # The step it fell in: what the loop measured without it, not with it.
        recorded = steps[p["step"]]["wall_s"]
        measured = own["steps"][p["step"]]
        assert abs(recorded - measured) < 0.5 * seconds, (recorded, measured, seconds)
    total = evaluation_stats(run.rows["events"])
    assert total is not None and total.to_dict()["passes"] == STEPS // EVERY

    # The median step with the evaluation is within noise of the loop's own, and of a run
    # without any evaluation (steps 1.. : step 0 runs from the agent's start).
    with_eval = statistics.median(s["wall_s"] for s in steps[1:])
    assert abs(with_eval - statistics.median(own["steps"][1:])) < 0.3 * with_eval
    _, plain_steps, plain_passes, _ = _run(tmp_path, "none", pure)
    assert plain_passes == []
    without = statistics.median(s["wall_s"] for s in plain_steps[1:])
    assert 0.5 < with_eval / without < 2.0, (with_eval, without)


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure-python"])
def test_a_teacher_called_once_under_no_grad_stays_in_the_step(tmp_path, pure):
    own, steps, passes, _ = _run(tmp_path, "teacher", pure)
    assert passes == []
    recorded = sum(s["wall_s"] for s in steps[1:])
    measured = sum(own["steps"][1:])
    # Nothing taken out: the recording holds at least the loop's own time (the agent's own
    # few microseconds a step and scheduling noise on a loaded box only add to it).
    assert recorded > 0.8 * measured, (recorded, measured)
