"""A real CPU training job that runs until the test says stop (a file appears), so that the
test decides how long Prometheus watches it instead of guessing a duration."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TRAIN = r"""
import os, sys
import torch
import torch.utils.data as tud

torch.set_num_threads(1)
stop = sys.argv[1]
ds = tud.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
epoch = 0
# Workers that are not persistent exit at the end of every epoch: the job's counters must not.
while not os.path.exists(stop) and epoch < 10000:
    for x, y in tud.DataLoader(ds, batch_size=16, num_workers=1, persistent_workers=False):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    epoch += 1
print("epochs", epoch, flush=True)
"""


@dataclass
class StoppableJob:
    """TRAIN under `torchdoctor run`: its recording, TensorBoard folder and stop file."""

    proc: subprocess.Popen
    recording: Path
    tensorboard: Path
    stop_file: Path
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""

    def finish(self) -> None:
        """Ask the job to stop and wait for it (once); its output is kept."""
        if self.returncode is None:
            self.stop_file.touch()
            self.stdout, self.stderr = self.proc.communicate(timeout=180)
            self.returncode = self.proc.returncode

    def ensure_stopped(self) -> None:
        """A fixture's teardown: a job that a failed test left running is stopped, and
        killed if it does not stop."""
        if self.returncode is None and self.proc.poll() is None:
            self.stop_file.touch()
            try:
                self.proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


def run_with_tensorboard(tmp_path: Path, tensorboard: Path) -> StoppableJob:
    """TRAIN started under `torchdoctor run --tensorboard TENSORBOARD`, recorded to
    ``tmp_path/job.sqlite``, until ``tmp_path/stop`` appears."""
    from tests.conftest import TORCHDOCTOR

    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = subprocess.Popen(
        [*TORCHDOCTOR, "run", "--tensorboard", str(tensorboard),
         "--out", str(tmp_path / "job.sqlite"), "--", sys.executable, str(script),
         str(tmp_path / "stop")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return StoppableJob(proc, tmp_path / "job.sqlite", tensorboard, tmp_path / "stop")
