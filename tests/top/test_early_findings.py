"""What top says of a job in its first seconds: no verdict (leak, saturation, contention) from
start-up, where imports grow the trainer by a hundred MiB and run one thread.

A real data-bound job (examples/scenarios/data_bound.py, pure-Python loading) under
`torchdoctor run`; top's recording watcher reads its live recording a few seconds in.
Contention is a true finding where other programs do take the CPUs: it is judged against the
CPU time other processes were measured to use meanwhile (tests/helpers/cpu_load.py), so the
test holds on a busy machine too.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, TORCHDOCTOR
from tests.helpers.cpu_load import LoadBesides, OtherLoad
from tests.helpers.live_recording import recorded_span
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.recordings import RecordingWatcher

pytestmark = pytest.mark.timeout(600)
DATA_BOUND = REPO / "examples" / "scenarios" / "data_bound.py"
VERDICTS = {"host-memory-leak", "cpu-saturated", "cpu-contention", "thread-oversubscription"}
# Other programs using this much CPU (in CPUs, on average) make "cpu-contention" a true finding:
# half a CPU taken from a job that wants them all.
CONTENDED_CPUS = 0.5


def test_no_leak_headline_in_a_jobs_first_seconds(tmp_path):
    path = tmp_path / "live.sqlite"
    job = subprocess.Popen(
        [*TORCHDOCTOR, "run", "--quiet", "--out", str(path), "--",
         sys.executable, str(DATA_BOUND), "--steps", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    others = OtherLoad(job.pid)
    machine = LoadBesides(job.pid)  # also sees short-lived processes (a test run beside)
    seen: list[list[str]] = []
    try:
        deadline = time.monotonic() + 240
        # Look at 2, 3.5 and 5 s of recording, as a user who starts top with the job would.
        for at in (2.0, 3.5, 5.0):
            while recorded_span(path) < at and job.poll() is None:
                assert time.monotonic() < deadline, "the recording did not grow"
                time.sleep(0.05)
            if job.poll() is not None:
                break
            watcher = RecordingWatcher(Thresholds())  # a fresh look: diagnoses at once
            try:
                status = watcher.status(path)
            finally:
                watcher.close()
            assert "findings" not in status.unavailable, status.unavailable
            seen.append([f.id for f in status.findings if f.severity in ("warning", "critical")])
            load = max(others.cpus(), machine.cpus())
            false = VERDICTS - ({"cpu-contention"} if load >= CONTENDED_CPUS else set())
            assert not false & set(seen[-1]), (at, f"others used {load:.2f} CPUs", status.findings)
    finally:
        job.wait(timeout=300)
    assert job.returncode == 0, job.stderr.read()
    assert seen, "the job ended before top could look at it"
