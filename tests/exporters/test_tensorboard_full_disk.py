"""TensorBoard output onto a full disk (probe minor 3): one line, never tensorboardX's thread
traceback, a hang or 'internal error'; `run --tensorboard` keeps the job and its recording
going, `export --format tensorboard` exits non-zero and leaves nothing behind. Small tmpfs
mounts (root), real recordings, real `torchdoctor` commands."""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.exporters.jobs import run_with_tensorboard
from tests.exporters.prom import wait_for
from tests.helpers.bad_input import small_tmpfs
from tests.helpers.dependencies import require
from torchdoctor.exporters.tensorboard import FLUSH_EVERY_S

STOPPED = "tensorboard output stopped: no space left on the device in "


def _fill(folder: Path) -> None:
    """Fill the tmpfs at ``folder`` to its last block."""
    with open(folder / "filler", "ab", buffering=0) as fh:
        for size in (4096, 512, 1):  # unbuffered: a refused write leaves nothing to flush
            try:
                while fh.write(b"\0" * size):
                    pass
            except OSError:
                pass


def _recording(tmp_path: Path) -> Path:
    out = tmp_path / "job.sqlite"
    job = tmp_path / "steps.py"
    job.write_text(
        "import torch\nm = torch.nn.Linear(4, 1)\no = torch.optim.SGD(m.parameters(), 0.1)\n"
        "for _ in range(200):\n    m(torch.randn(2, 4)).sum().backward(); o.step()\n"
    )
    res = run_td("run", "--quiet", "--out", str(out), "--", sys.executable, str(job))
    assert res.returncode == 0, res.stderr
    return out


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    require("tensorboardX")
    recording = _recording(tmp_path)
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        _fill(disk)
        res = run_td(
            "export", str(recording), "--format", "tensorboard", "--out-dir", str(disk / "tb"),
            timeout=120,
        )  # fmt: skip
        assert res.returncode != 0
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert lines == [f"torchdoctor: error: {STOPPED}'{disk / 'tb' / recording.stem}'"]
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_a_write_that_fails_is_said_and_the_partial_export_removed(tmp_path, monkeypatch):
    """In process: the free-space check let the pass begin (set to nothing), the disk fills up
    under the writes: the OSError of a write or flush is the same one line."""
    require("tensorboardX")
    from torchdoctor.exporters import tensorboard

    recording = _recording(tmp_path)
    monkeypatch.setattr(tensorboard, "_MIN_FREE_BYTES", 0)
    monkeypatch.setattr(tensorboard, "_POINT_BYTES", 0)
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        (disk / "filler").write_bytes(b"\0" * (60 * 1024))
        with pytest.raises(tensorboard.TensorBoardStopped) as caught:
            tensorboard.export_tensorboard(recording, disk / "tb")
        assert caught.value.message == f"{STOPPED}'{disk / 'tb' / recording.stem}'"
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_run_keeps_the_job_and_its_recording_when_the_disk_fills(tmp_path):
    require("tensorboardX")
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        job = run_with_tensorboard(tmp_path, disk / "tb")
        try:
            logdir = disk / "tb" / "job"
            wait_for("the first scalars", lambda: list(logdir.glob("*tfevents*")), every_s=0.5)
            _fill(disk)
            # The next pass (every 5 s) finds the disk full; the job goes on meanwhile.
            before = _steps(job.recording)
            wait_for(
                "steps recorded after the disk filled",
                lambda: _steps(job.recording) > before + 50,
                deadline_s=120,
                every_s=1.0,
            )
            time.sleep(FLUSH_EVERY_S + 1)  # a pass of the live writer while the job runs
        finally:
            job.finish()
    assert job.returncode == 0, job.stderr
    assert "epochs" in job.stdout
    said = [line for line in job.stderr.splitlines() if "tensorboard" in line.lower()]
    assert said == [
        f"torchdoctor: {STOPPED}'{logdir}'; the job keeps running and its recording goes on"
    ], job.stderr
    assert "Traceback" not in job.stderr and "internal error" not in job.stderr
    assert _steps(job.recording) > before + 50


def _steps(recording: Path) -> int:
    with sqlite3.connect(recording) as db:
        return db.execute("SELECT count(*) FROM steps").fetchone()[0]
