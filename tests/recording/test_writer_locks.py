"""A reader in the process that writes a recording must not release the writer's locks.

SQLite's locks are POSIX advisory locks: closing any descriptor of the file in the writer's
process drops them, and the next connection of another process to close then deletes the
live -wal and -shm files under the writer (found with `run --prometheus`, whose diagnosis reads
the recording in the recorder's process, and `show` of the live file). The header reads go
through recording.file_head, which keeps one descriptor while the writer holds the file."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from torchdoctor.recording import RecordingWriter
from torchdoctor.recording.reader import open_recording
from torchdoctor.recording.records import StepRecord


def step(n: int) -> StepRecord:
    return StepRecord(
        pid=1, rank=None, step=n, t_start=999.9 + n, t_end=1000.0 + n, wall_s=0.1, data_wait_s=0.0
    )


def test_reading_the_live_recording_in_the_writers_process_keeps_its_wal(tmp_path: Path) -> None:
    path = tmp_path / "live.sqlite"
    writer = RecordingWriter(path, meta={"command": ["python", "train.py"]})
    try:
        writer.add_steps([step(n) for n in range(5)])
        writer.flush()
        with open_recording(path) as rec:  # this process: reads the header, then closes
            assert rec.meta["command"] == ["python", "train.py"]
        # another process connects and closes, as `torchdoctor show` of the live file does
        code = (
            f"import sqlite3; db = sqlite3.connect({str(path)!r}); "
            "db.execute('SELECT COUNT(*) FROM steps').fetchone(); db.close()"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        assert Path(f"{path}-wal").exists() and Path(f"{path}-shm").exists()
        writer.add_steps([step(n) for n in range(5, 9)])
        writer.flush()
        # what the writer commits after that reaches a new reader: the file was never lost
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 9
    finally:
        writer.close()
    with open_recording(path) as rec:
        assert len(rec.steps()) == 9
