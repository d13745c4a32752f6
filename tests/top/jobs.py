"""Real PyTorch jobs for the live-view tests: a trainer with a DataLoader of 2 fork workers.

The job is started through a short-lived intermediate process so that it is reparented away
from pytest: when the test process itself has imported torch (other suites do), a job under it
would be part of pytest's tree instead of a job of its own, as `top` rightly shows.

The trainer prints one line, ``<its pid> <worker pid> <worker pid>``, once both workers have
produced a batch, then waits for its stdin to close: the test knows exactly when the tree is
complete, without sleeping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TRAINER = r"""
import os, sys
import torch
import torch.utils.data as tud

torch.set_num_threads(1)

class PidDataset(tud.Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        return os.getpid()

loader = tud.DataLoader(PidDataset(), batch_size=1, num_workers=2, multiprocessing_context="fork")
it = iter(loader)
workers = sorted({int(next(it)[0]), int(next(it)[0])})
print(os.getpid(), *workers, flush=True)
sys.stdin.read()
"""

# Starts the trainer with our stdin/stdout and exits at once: the trainer is orphaned.
LAUNCH = """
import subprocess, sys
subprocess.Popen([sys.executable, *sys.argv[1:]])
"""


@dataclass
class Job:
    pid: int
    workers: list[int]
    stdin: object
    pgid: int


@contextlib.contextmanager
def detached_job(folder: Path, *marker_args: str) -> Iterator[Job]:
    """A running ``python FOLDER/train.py MARKER_ARGS`` + 2 workers."""
    script = folder / "train.py"
    script.write_text(TRAINER)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(script), *marker_args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # One thread per process keeps the machine quiet, and gives the detail view an
        # environment variable of interest to show.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    pgid = launcher.pid
    try:
        line = launcher.stdout.readline()
        launcher.wait(timeout=60)
        parts = [int(x) for x in line.split()]
        assert len(parts) == 3, f"the trainer did not start: {line!r}"
        yield Job(pid=parts[0], workers=parts[1:], stdin=launcher.stdin, pgid=pgid)
    finally:
        with contextlib.suppress(OSError):
            launcher.stdin.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        launcher.stdout.close()
