"""Steps a profiler window touched (``profiled``) leave every step figure: the one summary
(``Recording.step_stats``, which show, diagnose and report print), compare's steady steps and
top's live rate; a recording without the column (written before windows) reads as before."""

from __future__ import annotations

import sqlite3
import time

import pytest

from torchdoctor.recording import open_recording
from torchdoctor.recording.records import StepRecord
from torchdoctor.recording.writer import RecordingWriter
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.recordings import RecordingWatcher

STEPS, PROFILED = 40, range(10, 15)  # a window of 10-13 (warm-up 10, closing step 14)


def write(path, end: float) -> None:
    writer = RecordingWriter(path, {"command": ["python", "train.py"], "started_at": end - 60})
    # 0.1 s steps; the window's steps ten times slower (the profiler, the export's stall).
    walls = [1.0 if i in PROFILED else 0.1 for i in range(STEPS)]
    t = end - sum(walls)
    rows = []
    for i, wall in enumerate(walls):
        rows.append(
            StepRecord(
                pid=7, rank=None, step=i, t_start=t, t_end=t + wall, wall_s=wall,
                data_wait_s=0.0, batch_size=32, samples=32, profiled=(i in PROFILED) or None,
            )
        )  # fmt: skip
        t += wall
    writer.add_steps(rows)
    writer.close()


def test_profiled_steps_leave_the_summary_and_top(tmp_path):
    now = time.time()
    path = tmp_path / "run.sqlite"
    write(path, now)
    with open_recording(path) as rec:
        stats = rec.step_stats()
    assert stats.step_count == STEPS
    assert stats.measured_steps == STEPS - STEPS // 10 - len(PROFILED)
    assert stats.median_step_s == stats.p90_step_s == pytest.approx(0.1)
    assert stats.steps_per_s == pytest.approx(10.0)
    status = RecordingWatcher(Thresholds(), window_s=60).status(path, now=now)
    assert status.step_rate_per_s == pytest.approx(10.0)


def test_a_recording_without_the_column_reads_as_before(tmp_path):
    path = tmp_path / "old.sqlite"
    write(path, time.time())
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE steps DROP COLUMN profiled")
    db.execute("DROP TABLE profile_windows")
    db.execute("DROP TABLE profile_sync_sites")
    db.commit()
    db.close()
    with open_recording(path) as rec:
        assert rec.step_stats().measured_steps == STEPS - STEPS // 10
        assert rec.profile_windows() == []
        assert rec.profile_sync_sites(1) == []
