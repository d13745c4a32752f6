"""A private queue per test: its own XDG folders, its own scheduler, a fake GPU machine shared
by every process of the test (tests/fake_nvml.py: the fake libnvidia-ml under the real pynvml)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import fake_nvml
from torchdoctor.queue.model import ACTIVE
from torchdoctor.queue.paths import queue_paths
from torchdoctor.queue.processes import is_alive
from torchdoctor.queue.store import QueueStore

TESTS = Path(__file__).resolve().parents[1]
HELPERS = TESTS / "helpers"
FAKE_JOB = str(HELPERS / "fake_cuda_job.py")

GIB = fake_nvml.GIB
UUID0 = "GPU-5d7a1c2e-0b9f-4e61-8c3a-40a100000000"
UUID1 = "GPU-5d7a1c2e-0b9f-4e61-8c3a-40a100000001"


class QueueEnv:
    """One user's queue in temporary folders, driven through the real `torchdoctor` command."""

    def __init__(self, root: Path, runtime: Path, gpus: list[dict]) -> None:
        self.root = root
        self.machine = str(root / "fake-gpus.json")
        fake_nvml.write_machine(self.machine, gpus)
        self.env = {
            **fake_nvml.machine_env(self.machine),
            "XDG_STATE_HOME": str(root / "state"),
            "XDG_RUNTIME_DIR": str(runtime),
            "TORCHDOCTOR_QUEUE_IDLE_EXIT_S": "300",  # a scheduler a test leaks goes away
        }
        self.paths = queue_paths(self.env)

    def td(self, *args: str, timeout: float = 120, check: bool = False, **kw):
        done = subprocess.run(
            [sys.executable, "-m", "torchdoctor", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            **kw,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"torchdoctor {' '.join(args)} -> {done.returncode}: {done.stderr}"
            )
        return done

    def submit(self, *args: str) -> int:
        return int(self.td("submit", "-q", *args, check=True).stdout)

    def wait(self, job_id: int) -> int:
        return self.td("queue", "wait", str(job_id), timeout=180).returncode

    def store(self) -> QueueStore:
        return QueueStore(self.paths.db)

    def job(self, job_id: int):
        store = self.store()
        try:
            return store.get(job_id)
        finally:
            store.close()

    def until(self, what, timeout: float = 60.0, every: float = 0.05):
        """Wait for a condition on the queue's state (an event we cannot be told of)."""
        deadline = time.monotonic() + timeout
        while True:
            value = what()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(every)

    def log(self, job_id: int) -> str:
        return Path(self.job(job_id).log).read_text()

    def job_report(self, job_id: int) -> dict:
        """The first line the fake job printed: its devices, threads and affinity."""
        return json.loads(self.log(job_id).splitlines()[0])

    def scheduler_pid(self) -> int | None:
        if not self.paths.db.exists():
            return None
        store = self.store()
        try:
            pid, start = store.meta("scheduler_pid"), store.meta("scheduler_start")
        finally:
            store.close()
        if pid is None or start in (None, "None") or not is_alive(int(pid), int(start)):
            return None
        return int(pid)

    def stop(self) -> None:
        """Stop what this test's queue started, by PID: its scheduler, then any job left."""
        pid = self.scheduler_pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            self.until(lambda: self.scheduler_pid() is None, timeout=30)
        if not self.paths.db.exists():
            return
        kill_jobs_left(self.store())


def kill_jobs_left(store: QueueStore) -> None:
    """Kill, by PID and start time, the supervisor and job of every job a test's queue
    left running; the store is closed."""
    try:
        for job in store.jobs(ACTIVE):
            for who, start in (
                (job.supervisor_pid, job.supervisor_start),
                (job.job_pid, job.job_start),
            ):
                if is_alive(who, start):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(who, signal.SIGKILL)
    finally:
        store.close()


@pytest.fixture
def queue_env(tmp_path):
    made: list[QueueEnv] = []
    runtime = Path(tempfile.mkdtemp(prefix="tdq-"))  # a socket path must stay short

    def make(gpus: list[dict] | None = None) -> QueueEnv:
        env = QueueEnv(tmp_path, runtime, gpus or [])
        made.append(env)
        return env

    yield make
    for env in made:
        env.stop()


def one_gpu(total_gib: int = 40) -> list[dict]:
    return [{"uuid": UUID0, "name": "NVIDIA A100-PCIE-40GB", "memory_total": total_gib * GIB}]
