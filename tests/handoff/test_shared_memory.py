"""Shared memory measured: RssShmem per process and the /dev/shm files the job holds, shown by
`show`, sized by the hand-off; a recording made before says "not measured" and still opens."""

from __future__ import annotations

import mmap
import os
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.helpers.dependencies import require
from torchdoctor.sampling import procfs

JOB = Path(__file__).parent / "jobs" / "shm_loader.py"
MIB = 1024 * 1024


def _shm_file(name: str, size: int) -> int:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"x" * size)
    os.unlink(f"/dev/shm/{name}")  # as torch does: the descriptor keeps it
    return fd


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
def test_open_and_mapped_dev_shm_files_are_found() -> None:
    opened = _shm_file(f"td-test-open-{os.getpid()}", 2 * MIB)
    mapped_fd = _shm_file(f"td-test-map-{os.getpid()}", 3 * MIB)
    mapped = mmap.mmap(mapped_fd, 3 * MIB)
    os.close(mapped_fd)  # mapped only now
    try:
        files = procfs.dev_shm_files(os.getpid())
        sizes = sorted(files.values())
        assert 2 * MIB in sizes and 3 * MIB in sizes, files
        st = os.fstat(opened)
        assert files[(st.st_dev, st.st_ino)] == 2 * MIB
    finally:
        mapped.close()
        os.close(opened)


def test_rss_shmem_is_read_from_status() -> None:
    assert procfs.parse_rss_shmem(b"Name:\tx\nRssShmem:\t   2048 kB\nVmSwap:\t0 kB\n") == 2 * MIB
    assert procfs.parse_rss_shmem(b"Name:\tx\nVmSwap:\t0 kB\n") is None
    with open("/proc/self/status", "rb") as f:
        assert procfs.parse_rss_shmem(f.read()) is not None


@pytest.fixture(scope="module")
def shm_recording(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shm") / "loader.sqlite"
    res = run_td(
        "run", "--quiet", "--interval", "0.2", "--out", str(path), "--",
        sys.executable, str(JOB), timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return path


def test_the_job_s_shared_memory_is_recorded_shown_and_sized(shm_recording: Path) -> None:
    shown = run_td("show", str(shm_recording))
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if "/dev/shm held" in line)
    peak = row.split()[-2:]
    assert peak[1] == "MiB" and float(peak[0]) >= 16, row  # one 16 MiB batch at least
    assert "RssShmem" in shown.stdout and "not measured" not in shown.stdout
    require("yaml")
    res = run_td(
        "handoff", "--to", "job", "--from", str(shm_recording), "--image", "x:1", "--",
        sys.executable, str(JOB),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "# /dev/shm: peak shared memory of the whole job" in res.stdout
    assert "not measured" not in res.stdout


def test_a_recording_made_before_says_not_measured(shm_recording: Path, tmp_path: Path) -> None:
    old = tmp_path / "old.sqlite"
    shutil.copy(shm_recording, old)
    with sqlite3.connect(old) as db:  # the columns a recording of an older torchdoctor lacks
        db.execute("ALTER TABLE process_samples DROP COLUMN dev_shm")
        db.execute("ALTER TABLE process_samples DROP COLUMN shmem")
    shown = run_td("show", str(old))
    assert shown.returncode == 0, shown.stderr
    assert "shared memory: not measured (the recording predates its sampling)" in shown.stdout
    res = run_td(
        "handoff", "--to", "job", "--from", str(old), "--image", "x:1", "--",
        sys.executable, str(JOB),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "shared memory not measured" in res.stdout
