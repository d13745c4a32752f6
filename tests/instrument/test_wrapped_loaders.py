"""A DataLoader wrapped by another built from it (accelerate's prepare(), which the HF Trainer
calls) is one loader in the recording: the one the job iterated."""

from __future__ import annotations

from tests.helpers.dependencies import require
from tests.instrument.runjob import JOBS, PY, run_job


def test_a_loader_wrapped_by_accelerate_is_listed_once(tmp_path):
    require("accelerate")
    run = run_job([PY, str(JOBS / "accelerate_job.py")], tmp_path / "r.sqlite")
    assert run.returncode == 0 and run.stdout == "DataLoaderShard steps 8\n", run.stderr
    (loader,) = run.rows["dataloaders"]  # the Trainer's own loader was listed beside it
    assert loader["first_batch_s"] is not None  # the shard: it was iterated
    assert len(run.rows["steps"]) == 8
    assert len(run.events("epoch-start")) == 1
