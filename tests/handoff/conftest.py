"""Real recordings the hand-off tests size from: the sbatch tests' own, made once per session."""

from tests.slurm.conftest import ddp_recording, train_recording  # noqa: F401
