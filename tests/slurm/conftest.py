"""Real recordings the sbatch tests size from, made once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_td

TRAIN = REPO / "examples" / "train.py"
DDP = Path(__file__).parent / "jobs" / "ddp_train.py"
# Small batches keep the job short on a loaded 2-CPU machine; it still waits for its data.
TRAIN_CMD = [sys.executable, str(TRAIN), "--steps", "20", "--batch-size", "4"]
DDP_CMD = [sys.executable, str(DDP), "--steps", "30"]


@pytest.fixture(scope="session")
def train_recording(tmp_path_factory) -> Path:
    """`torchdoctor run -- python examples/train.py --steps 20` (small batches), for real."""
    path = tmp_path_factory.mktemp("rec") / "train.sqlite"
    res = run_td(
        "run", "--quiet", "--out", str(path), "--", *TRAIN_CMD, timeout=300
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return path


@pytest.fixture(scope="session")
def ddp_recording(tmp_path_factory) -> Path:
    """A 2-rank gloo job under torchrun on this machine, recorded for real."""
    path = tmp_path_factory.mktemp("rec") / "ddp.sqlite"
    res = run_td(
        "run", "--quiet", "--out", str(path), "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        *DDP_CMD[1:], timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return path
