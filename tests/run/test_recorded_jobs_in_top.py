"""Every recording path announces its job: `torchdoctor top --once --json` shows a tune trial
and a ``torchdoctor.watch()`` job with their recordings while they run, and not after."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import run_td
from torchdoctor.recording import registry
from torchdoctor.tune.result import OK
from torchdoctor.tune.space import Config
from torchdoctor.tune.trial import TrialLimits, TrialRunner

JOB = str(Path(__file__).resolve().parent / "jobs" / "gated.py")
READY_WITHIN_S = 240  # python + torch starting on a loaded 2-core machine


class Gates:
    """The test's side of the job's gates (see jobs/gated.py): two FIFOs."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        os.mkfifo(folder / "ready")
        os.mkfifo(folder / "go")
        # Opened now, non-blocking: the job's open for writing then never blocks, and poll()
        # reports nothing until the job has written (no hang-up before a first writer).
        self._ready = os.open(folder / "ready", os.O_RDONLY | os.O_NONBLOCK)
        self._buffer = b""

    def wait_ready(self, alive) -> int:
        """The job's PID once it stands at a gate; fails when the job ends first."""
        poller = select.poll()
        poller.register(self._ready, select.POLLIN)
        deadline = time.monotonic() + READY_WITHIN_S
        while b"\n" not in self._buffer:
            assert alive(), "the job ended before reaching its gate"
            assert time.monotonic() < deadline, "the job never reached its gate"
            if poller.poll(500):
                try:
                    self._buffer += os.read(self._ready, 64)
                except BlockingIOError:
                    continue  # woken with nothing to read yet (the writer only just opened)
        line, self._buffer = self._buffer.split(b"\n", 1)
        return int(line)

    def release(self, *, if_waiting: bool = False) -> None:
        """Let the job go on (it reads EOF); ``if_waiting``: only if it stands at the gate."""
        flags = os.O_WRONLY | (os.O_NONBLOCK if if_waiting else 0)
        try:
            os.close(os.open(self.folder / "go", flags))
        except OSError:  # ENXIO: nobody at the gate
            if not if_waiting:
                raise

    def close(self) -> None:
        os.close(self._ready)


def recorded_jobs(path: Path) -> list[dict]:
    """The jobs `torchdoctor top --once --json` shows with ``path`` as their recording."""
    result = run_td("top", "--once", "--json", "--interval", "0.3", env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    jobs = json.loads(result.stdout)["jobs"]
    return [j for j in jobs if j["recording"] and j["recording"]["path"] == str(path.resolve())]


def test_a_tune_trial_is_shown_in_top_while_it_runs(runtime_dir, tmp_path):
    gates = Gates(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDOCTOR_")}
    runner = TrialRunner(
        executable=sys.executable,
        argv=[sys.executable, JOB, str(tmp_path)],
        folder=tmp_path / "trials",
        env=env,
        measured_steps=5,
        # The trial waits at its gate while top looks: no hang as far as tune is concerned.
        limits=TrialLimits(startup_s=READY_WITHIN_S, stall_s=180),
    )
    done: list = []
    thread = threading.Thread(target=lambda: done.append(runner(Config(0, 1), "search", None)))
    thread.start()
    try:
        pid = gates.wait_ready(thread.is_alive)
        (entry,) = registry.active()
        assert entry.pid == pid
        shown = recorded_jobs(entry.recording_path)
        assert shown, f"top does not show the trial {pid} with its recording"
        assert pid in {p["pid"] for p in shown[0]["processes"]}
        gates.release()
        thread.join(timeout=READY_WITHIN_S)
    finally:
        if thread.is_alive():
            gates.release(if_waiting=True)
            thread.join()
        runner.close()
        gates.close()
    (trial,) = done
    assert trial.status == OK, trial.reason
    assert registry.active() == [], "the trial's entry outlived it"
    assert recorded_jobs(Path(trial.recording)) == []


def test_a_watch_job_is_shown_in_top_until_its_watch_stops(runtime_dir, tmp_path):
    gates = Gates(tmp_path)
    out = tmp_path / "watched.sqlite"
    job = subprocess.Popen(
        [sys.executable, JOB, str(tmp_path), "--watch", str(out), "--steps", "20"]
    )
    try:
        pid = gates.wait_ready(lambda: job.poll() is None)
        shown = recorded_jobs(out)
        assert shown, f"top does not show the watched job {pid} with its recording"
        assert pid in {p["pid"] for p in shown[0]["processes"]}
        gates.release()
        # The watch has stopped; the process still runs (at its second gate).
        assert gates.wait_ready(lambda: job.poll() is None) == pid
        assert recorded_jobs(out) == []
        assert registry.active() == []
        gates.release()
        assert job.wait(timeout=120) == 0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        gates.close()
