"""`torchdoctor attach PID`: records a running tree until it exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import TORCHDOCTOR, run_td
from torchdoctor import open_recording

TREE = textwrap.dedent(
    """
    import os, sys
    r, w = os.pipe()
    if os.fork() == 0:          # a worker child that lives as long as the parent
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    print(os.getpid(), flush=True)
    sys.stdin.readline()       # the test says when to finish
    os.close(w)
    os.wait()
    """
)


def test_attach_records_the_tree_until_it_exits(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "3", "NCCL_DEBUG": "INFO"}  # the job's, not ours
    job = subprocess.Popen(
        [sys.executable, "-c", TREE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    pid = int(job.stdout.readline())
    rec = tmp_path / "a.sqlite"
    attach = subprocess.Popen(
        [*TORCHDOCTOR, "attach", str(pid), "--interval", "0.1", "--out", str(rec)],
        stderr=subprocess.PIPE,
        text=True,
    )
    first_line = attach.stderr.readline()
    assert f"recording PID {pid}" in first_line and str(rec) in first_line
    _wait_for_samples(rec, 3)
    job.stdin.write("done\n")
    job.stdin.flush()
    job.wait(timeout=30)
    attach.wait(timeout=60)
    assert attach.returncode == 0
    with open_recording(rec) as r:
        pids = {p["pid"] for p in r.processes()}
        assert pid in pids and len(pids) == 2
        assert r.meta["mode"] == "attach"
        assert r.meta["env"]["OMP_NUM_THREADS"] == "3" and r.meta["env"]["NCCL_DEBUG"] == "INFO"
        assert r.meta["command"][:2] == [sys.executable, "-c"]
        assert r.complete


def test_attach_no_such_pid(tmp_path: Path) -> None:
    res = run_td("attach", "999999999", "--out", str(tmp_path / "x.sqlite"))
    assert res.returncode == 2
    assert res.stderr.strip().startswith("torchdoctor: error: no such process: 999999999")
    assert not (tmp_path / "x.sqlite").exists()


def _wait_for_samples(path: Path, n: int) -> None:
    import sqlite3
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists():
            try:
                db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
                count = db.execute("SELECT COUNT(*) FROM process_samples").fetchone()[0]
                db.close()
                if count >= n:
                    return
            except sqlite3.Error:
                pass
        time.sleep(0.05)
    raise AssertionError("attach recorded nothing")
