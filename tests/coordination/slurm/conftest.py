"""Real recordings the sbatch tests size from, made once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_td

TRAIN = REPO / "examples" / "train.py"
DDP = Path(__file__).parent / "jobs" / "ddp_train.py"


@pytest.fixture(scope="session")
def train_recording(tmp_path_factory) -> Path:
    """`torchdoctor run -- python examples/train.py --steps 20`, recorded for real."""
    path = tmp_path_factory.mktemp("rec") / "train.sqlite"
    res = run_td(
        "run", "--quiet", "--out", str(path), "--", sys.executable, str(TRAIN), "--steps", "20"
    )
    assert res.returncode == 0, res.stderr
    return path


@pytest.fixture(scope="session")
def ddp_recording(tmp_path_factory) -> Path:
    """A 2-rank gloo job under torchrun on this machine, recorded for real."""
    path = tmp_path_factory.mktemp("rec") / "ddp.sqlite"
    res = run_td(
        "run", "--quiet", "--out", str(path), "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(DDP), "--steps", "30",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return path
