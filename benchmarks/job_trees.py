"""Real process trees for the scale benchmarks, and the sampler's snapshots of them.

One definition of each job shape the benchmarks record, so that a figure "at 72 processes"
is measured on the same tree wherever it appears:

- ``TRAINER_JOB``: a trainer and 19 workers that wake now and then (soak.py's 20-process job);
- ``node_job()``: a node of a distributed job, a launcher above 8 ranks with 8 DataLoader
  workers each (72 job processes and the launcher), the workers forked from their rank as a
  DataLoader forks them, the ranks optionally importing torch first so that every process maps
  libtorch as real ones do (what makes PSS, smaps_rollup, dear: snapshot_cost.py).

Each job prints ``ready`` once its whole tree runs and ends its tree when its stdin closes.
``RecordedJob`` keeps a recording of a running tree as `torchdoctor run` does (scrape_cost.py,
many_jobs.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from torchdoctor.recording import RecordingWriter
from torchdoctor.recording.compaction import CompactionPolicy
from torchdoctor.recording.records import StepRecord
from torchdoctor.sampling.host import HostReader
from torchdoctor.sampling.job import JobReader
from torchdoctor.sampling.sampler import Sampler
from torchdoctor.sampling.types import Snapshot

# A 20-process job: one parent and 19 children that wake up now and then, like workers.
TRAINER_JOB = (
    "import subprocess, sys\n"
    "kids = [subprocess.Popen([sys.executable, '-c',"
    " 'import time\\nwhile True: time.sleep(0.2); sum(range(2000))']) for _ in range(19)]\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
    "for k in kids: k.kill()\n"
    "for k in kids: k.wait()\n"
)

RECORDING_INTERVAL_S = 0.5  # the recorder's default interval
# Snapshots taken before the kept ones: the first readings have no rates yet.
UNSETTLED = 3


def node_job(ranks: int = 8, workers: int = 8, *, torch: bool = False) -> str:
    """A launcher above ``ranks`` ranks with ``workers`` forked workers each; the launcher
    kills its whole process group (it runs in a session of its own) when its stdin closes."""
    rank = (
        "import os, sys, time\n"
        + ("import torch\ntorch.ones(1)\n" if torch else "")
        + f"for _ in range({workers}):\n"
        "    if os.fork() == 0:\n"
        "        while True: time.sleep(0.2); sum(range(2000))\n"
        "print('up', flush=True)\n"
        "while True: time.sleep(0.1); sum(range(20000))\n"
    )
    return (
        "import subprocess, sys, os, signal\n"
        f"ranks = [subprocess.Popen([sys.executable, '-c', {rank!r}], stdout=subprocess.PIPE)"
        f" for _ in range({ranks})]\n"
        "for r in ranks: r.stdout.readline()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
        "os.killpg(0, signal.SIGKILL)\n"
    )


@contextlib.contextmanager
def running(script: str) -> Iterator[subprocess.Popen]:
    """``python -c script`` running with its whole tree up; ended (stdin closed) on exit."""
    job = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: node_job's launcher kills the whole tree
    )
    try:
        if job.stdout.readline() != "ready\n":
            raise SystemExit("the benchmark's job tree did not start")
        yield job
    finally:
        job.stdin.close()
        job.wait(60)


def snapshots(pid: int, n: int, pause_s: float) -> tuple[list, list]:
    """``n`` snapshots of the tree under ``pid`` ``pause_s`` apart (past the first readings,
    which have no rates), and the descriptions of every process seen."""
    sampler = Sampler(HostReader(pid=pid), JobReader(pid), None)
    try:
        snaps = []
        for _ in range(n + UNSETTLED):
            snaps.append(sampler.snapshot())
            time.sleep(pause_s)  # the snapshots' spacing, not a wait for an event
    finally:
        sampler.close()
    infos = [p for s in snaps for p in s.new_processes]
    return snaps[UNSETTLED:], infos


def stamped(snap: Snapshot, t: float) -> Snapshot:
    """``snap`` (host and processes) as taken at ``t``: a replay writes real snapshots at
    the times of the run it builds."""
    snap.t = t
    if snap.host is not None:
        snap.host.t = t
    for p in snap.processes:
        p.t = t
    return snap


class RecordedJob:
    """A running job's recording as `torchdoctor run` keeps it: real snapshots of the tree
    under ``pid`` and step records written through the recording writer, starting with
    ``history_s`` of history; :meth:`advance` adds what more seconds of the job add."""

    def __init__(
        self,
        pid: int,
        path: Path,
        *,
        history_s: float,
        steps_per_s: float,
        compaction: CompactionPolicy | None = None,
    ) -> None:
        self.pid = pid
        self.path = path
        self.steps_per_s = steps_per_s
        self.t = time.time() - history_s
        self.writer = RecordingWriter(
            path, {"started_at": self.t, "mode": "run"}, compaction=compaction
        )
        self.sampler = Sampler(HostReader(pid=pid), JobReader(pid), None)
        self.steps = 0
        self.advance(history_s)

    def advance(self, seconds: float) -> None:
        """Record ``seconds`` more of the job: a snapshot of its tree per interval, its steps."""
        for k in range(1, round(seconds / RECORDING_INTERVAL_S) + 1):
            # On the job's clock, as the steps are: the history is recorded in a moment
            snap = stamped(self.sampler.snapshot(), self.t + k * RECORDING_INTERVAL_S)
            self.writer.write_snapshot(snap)
        wall = 1.0 / self.steps_per_s
        records = []
        for _ in range(round(seconds * self.steps_per_s)):
            t_start = self.t
            self.t += wall
            records.append(
                StepRecord(
                    pid=self.pid, rank=None, step=self.steps, t_start=t_start, t_end=self.t,
                    wall_s=wall, data_wait_s=wall * 0.2, batch_size=32,
                )
            )  # fmt: skip
            self.steps += 1
        self.writer.add_steps(records)
        self.writer.flush()

    def close(self) -> None:
        self.sampler.close()
        self.writer.close()
