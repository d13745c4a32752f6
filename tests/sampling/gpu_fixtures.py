"""Fixtures for the GPU reader tests: the fake NVML module and real processes to put on it.

Kept out of conftest.py (shared with the other sampling tests); test modules import from here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from torchdoctor.sampling.pidns import PidNamespace

TESTS_DIR = Path(__file__).resolve().parents[1]


def load_fake_nvml() -> ModuleType:
    """tests/fake_nvml.py, whichever import mode pytest runs in."""
    loaded = sys.modules.get("fake_nvml")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("fake_nvml", TESTS_DIR / "fake_nvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fake_nvml"] = module
    spec.loader.exec_module(module)
    return module


fake_nvml = load_fake_nvml()

# The fake NVML reports the PIDs our tests see as if they were host PIDs. Where the tests run in
# a PID namespace of their own (CI in a container) that premise must be stated to the reader;
# the real detection is tested on its own (test_own_pid_namespace_leaves_nvml_pids_unresolved).
HOST_PIDS = PidNamespace(procfs_is_host=True)

# A parent that starts one worker, reports the worker's PID, then waits for its stdin to close.
_JOB_SCRIPT = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                          stdin=subprocess.PIPE)
print(worker.pid, flush=True)
sys.stdin.read()
worker.stdin.close()
worker.wait()
"""


@dataclass
class JobTree:
    trainer: subprocess.Popen
    worker_pid: int


@pytest.fixture
def job_tree() -> Iterator[JobTree]:
    """A real trainer process with one real worker child."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", _JOB_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        worker_pid = int(trainer.stdout.readline())
        yield JobTree(trainer, worker_pid)
    finally:
        assert trainer.stdin is not None
        trainer.stdin.close()
        trainer.wait(timeout=10)


@pytest.fixture
def outsider() -> Iterator[subprocess.Popen]:
    """A real process that is not part of any job under test."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
