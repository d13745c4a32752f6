"""Complete, in progress, or cut short: told from the writer's identity, not guessed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from torchdoctor import open_recording
from torchdoctor.recording import RecordingWriter, state
from torchdoctor.recording.state import COMPLETE, CUT_SHORT, IN_PROGRESS
from torchdoctor.sampling import procfs
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.recordings import RecordingWatcher

# A recorder that commits its start, then dies as SIGKILL leaves it: no end, no close.
DYING_WRITER = """\
import os, sys
from torchdoctor.recording import RecordingWriter
w = RecordingWriter(sys.argv[1], {"command": ["python", "train.py"], "started_at": 1.0})
w.flush()
os.kill(os.getpid(), 9)
"""


def test_a_writer_alive_is_in_progress_and_complete_once_ended(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    writer = RecordingWriter(path, {"command": ["python", "train.py"], "started_at": time.time()})
    with open_recording(path) as rec:
        assert rec.state.kind == IN_PROGRESS
        assert rec.notes() == [
            f"recording in progress (pid {os.getpid()} writing, nothing sampled yet)"
        ]
    watcher = RecordingWatcher(Thresholds())
    try:
        assert watcher.status(path).recording_note is None  # written as it should be: no line
    finally:
        watcher.close()
    writer.close({"ended_at": time.time(), "exit_status": 0})
    with open_recording(path) as rec:
        assert rec.state.kind == COMPLETE and rec.notes() == []


def test_a_writers_stat_file_cut_short_reads_as_gone_not_as_an_error(monkeypatch) -> None:
    # A stat file read while its process exits can come back short: the registry's liveness
    # test and the recording's agree that such a writer is gone.
    identity = state.writer_identity()
    assert state.writer_alive(identity) is True
    monkeypatch.setattr(procfs, "read_path", lambda path: b"1 (python) S")
    assert state.writer_alive(identity) is False


def test_a_writer_that_died_is_cut_short_in_show_and_top(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    res = subprocess.run([sys.executable, "-c", DYING_WRITER, str(path)], timeout=60)
    assert res.returncode == -9
    with open_recording(path) as rec:
        assert rec.state.kind == CUT_SHORT and rec.state.writer_gone
        (note,) = rec.notes()
    assert note.startswith("recording cut short (its recorder, pid ") and "is gone" in note
    watcher = RecordingWatcher(Thresholds())
    try:
        assert "is gone" in watcher.status(path).recording_note
    finally:
        watcher.close()


def test_a_writer_closed_before_the_end_of_the_run_is_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    RecordingWriter(path, {"command": ["python"], "started_at": time.time()}).close()
    with open_recording(path) as rec:
        assert rec.state.kind == CUT_SHORT and not rec.state.writer_gone
        assert "the recorder stopped before the job ended" in rec.notes()[0]
