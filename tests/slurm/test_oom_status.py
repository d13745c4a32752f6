"""`slurm status` of a job the OOM killer ended: the recording, written on the node by the real
recorder inside a 400 MiB cgroup, tells it (Slurm's own name, OUT_OF_MEMORY) and who died."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torchdoctor.slurm.status import job_report

HOG = Path(__file__).resolve().parents[1] / "helpers" / "memory_hog.py"


def test_an_oom_killed_job_says_so_from_its_recording(tmp_path, memory_cgroup):
    folder = tmp_path / "slurm-77"
    folder.mkdir()
    procs = os.path.join(memory_cgroup.path, "cgroup.procs")
    env = {**os.environ, "SLURM_JOB_ID": "77"}  # as srun sets it on the node
    done = subprocess.run(
        [sys.executable, "-m", "torchdoctor", "run", "--quiet", "--interval", "0.2", "--out",
         str(folder / "node1.sqlite"), "--", sys.executable, str(HOG), procs, "8", "0.05"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 137, done.stderr
    report = job_report("77", tmp_path)
    assert report.state.state == "OUT_OF_MEMORY"
    assert report.state.exit_code == "137:0"
    (note,) = [n for n in report.notes if n.startswith("OOM-killed on ")]
    assert "400 MiB memory limit" in note
