"""A profiler window in a real 2-rank torchrun job (gloo, CPU) under `torchdoctor launch`:
every rank profiles the same steps and writes its own trace."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import time
from pathlib import Path

from tests.conftest import TORCHDOCTOR, run_td
from tests.profile.test_window import wait_for_steps
from torchdoctor.recording import open_recording
from torchdoctor.recording.paths import profile_folder

JOB = Path(__file__).resolve().parents[1] / "launch" / "jobs" / "ddp_job.py"


def test_every_rank_profiles_the_same_steps(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDOCTOR_")}
    env.pop("OMP_NUM_THREADS", None)
    res = run_td(
        "launch", "--quiet", "--nproc-per-node", "2", "--out-dir", str(tmp_path),
        "--profile-steps", "5-7", "--", str(JOB),
        env=env, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (recording,) = tmp_path.glob("*.sqlite")
    with open_recording(recording) as rec:
        windows = sorted(rec.profile_windows(), key=lambda w: w.rank)
        profiled = {(r["rank"], r["step"]) for r in rec.steps() if r["profiled"]}
    assert [(w.rank, w.state, w.first_step, w.last_step) for w in windows] == [
        (0, "done", 5, 7),
        (1, "done", 5, 7),
    ]
    assert profiled == {(rank, step) for rank in (0, 1) for step in range(4, 9)}
    for window in windows:
        path = Path(window.trace_path)
        assert path == profile_folder(recording) / f"rank{window.rank}-steps5-7.pt.trace.json.gz"
        with gzip.open(path, "rt") as fh:
            trace = json.load(fh)
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"ProfilerStep#5", "ProfilerStep#7"} <= names
        assert trace["distributedInfo"]["rank"] == window.rank


def test_profile_arms_both_ranks_of_a_running_launch_at_the_same_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDOCTOR_")}
    env.pop("OMP_NUM_THREADS", None)
    job = subprocess.Popen(
        [*TORCHDOCTOR, "launch", "--quiet", "--nproc-per-node", "2", "--out-dir", str(tmp_path),
         "--", str(JOB), "--epochs", "1000"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob("*.sqlite")) and time.monotonic() < deadline:
            time.sleep(0.5)
        (recording,) = tmp_path.glob("*.sqlite")
        wait_for_steps(recording, 6)
        asked = run_td("profile", str(recording), "--steps", "2", "--timeout", "180", timeout=300)
        assert asked.returncode == 0, asked.stderr
        with open_recording(recording) as rec:
            windows = sorted(rec.profile_windows(), key=lambda w: w.rank)
    finally:
        job.terminate()
        job.wait(120)
    assert [w.rank for w in windows] == [0, 1]
    assert {(w.state, w.first_step, w.last_step) for w in windows} == {
        ("done", windows[0].first_step, windows[0].first_step + 1)
    }
    assert all(w.trace_path in asked.stderr for w in windows)
