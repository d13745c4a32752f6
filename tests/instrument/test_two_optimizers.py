"""A job with two optimizers (a GAN): the settings of both are recorded, and the parameters of
both counted, on the compiled and the pure-Python path (the second optimizer's step takes the
full step handler on both)."""

from __future__ import annotations

import json

import pytest

from tests.instrument.runjob import JOBS, PY, run_job
from torchdoctor.instrument.agent import compiled
from torchdoctor.instrument.agent.contract import ENV_PURE_PYTHON

GENERATOR = 8 * 32 + 32 + 32 * 16 + 16
DISCRIMINATOR = 16 + 1


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure-python"])
def test_both_optimizers_settings_are_kept(tmp_path, pure):
    if not pure and compiled.fast is None:
        pytest.skip(f"no compiled path in this install ({compiled.FAST_PATH})")
    run = run_job(
        [PY, str(JOBS / "two_optimizers_job.py")],
        tmp_path / "r.sqlite",
        env={ENV_PURE_PYTHON: "1"} if pure else None,
    )
    assert run.returncode == 0 and run.stdout == "steps 12\n", run.stderr
    (pid,) = {r["pid"] for r in run.rows["steps"]}
    assert len(run.rows["steps"]) == 12  # one step a batch: both optimizers step in it
    settings = {k: json.loads(v) for k, v in run.settings_of(pid).items()}
    assert settings["optimizer.class"] == "torch.optim.sgd.SGD"  # the first to step
    assert [(o["class"], o["params"]) for o in settings["optimizers"]] == [
        ("torch.optim.sgd.SGD", DISCRIMINATOR),
        ("torch.optim.adam.Adam", GENERATOR),
    ]
    assert settings["params.count"] == GENERATOR + DISCRIMINATOR
    assert settings["params.bytes"] == 4 * (GENERATOR + DISCRIMINATOR)
