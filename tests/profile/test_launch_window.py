"""A profiler window in a real 2-rank torchrun job (gloo, CPU) under `torchdoctor launch`:
every rank profiles the same steps and writes its own trace."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from tests.conftest import run_td
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
