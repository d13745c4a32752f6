"""Recordings that are no regular file, or were edited or damaged by hand: every reader says so
in one line and exits 2, never hangs or prints a traceback, and leaves the file as it was."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import sys
from pathlib import Path

import pytest

from tests.conftest import run_td

PY = sys.executable


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    """One real `torchdoctor run` of a tiny Python job."""
    path = tmp_path_factory.mktemp("bad") / "good.sqlite"
    res = run_td(
        "run", "--quiet", "--interval", "0.05", "--out", str(path), "--",
        PY, "-c", "import time; time.sleep(0.3)",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return path


def _edited(recording: Path, folder: Path, name: str, sql: str) -> Path:
    copy = folder / f"{name}.sqlite"
    copy.write_bytes(recording.read_bytes())
    db = sqlite3.connect(copy)
    db.executescript(sql)
    db.commit()
    db.close()
    return copy


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(res, *words: str) -> None:
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(
    "command",
    [
        ["show"],
        ["diagnose"],
        ["export", "--format", "csv"],
        ["report"],
        ["sbatch", "-o", "job.sh", "--from"],
    ],
)
def test_a_fifo_is_refused_by_every_reader_without_opening_it(tmp_path: Path, command) -> None:
    fifo = tmp_path / "f.sqlite"
    os.mkfifo(fifo)
    # no writer ever opens it: a reader that opened it would wait until the timeout
    args = [*command, str(fifo)] + (["--", "python", "train.py"] if command[0] == "sbatch" else [])
    res = run_td(*args, cwd=tmp_path, timeout=60)
    _one_line(res, "'", "f.sqlite' is not a regular file")


def test_diagnose_of_a_folder_holding_a_fifo_reads_only_its_recordings(
    recording: Path, tmp_path: Path
) -> None:
    (tmp_path / "a.sqlite").write_bytes(recording.read_bytes())
    os.mkfifo(tmp_path / "f.sqlite")
    res = run_td("diagnose", str(tmp_path), timeout=60)
    assert res.returncode == 0, res.stderr


def test_show_of_a_device_says_it_is_no_regular_file() -> None:
    _one_line(run_td("show", "/dev/null"), "'/dev/null' is not a regular file")


EDITS = {
    "meta-not-json": ("UPDATE meta SET value = '{not json' WHERE key = 'host'", "meta 'host'"),
    "schema-version-abc": (
        "UPDATE meta SET value = 'abc' WHERE key = 'schema_version'",
        "meta 'schema_version'",
    ),
    "started-at-text": (
        """UPDATE meta SET value = '"abc"' WHERE key = 'started_at'""",
        "meta 'started_at'",
    ),
    "meta-dropped": ("DROP TABLE meta", "table 'meta' is missing"),
    "steps-dropped": ("DROP TABLE steps", "table 'steps' is missing"),
    "host-samples-dropped": ("DROP TABLE host_samples", "table 'host_samples' is missing"),
    "events-dropped": ("DROP TABLE events", "table 'events' is missing"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("command", [["show"], ["diagnose"], ["export", "--format", "csv"]])
def test_an_edited_recording_is_one_line_and_left_as_it_was(
    recording: Path, tmp_path: Path, edit: str, command: list[str]
) -> None:
    sql, what = EDITS[edit]
    copy = _edited(recording, tmp_path, edit, sql)
    before = _digest(copy)
    res = run_td(*command, str(copy), cwd=tmp_path)
    _one_line(res, "is damaged or edited", what)
    assert _digest(copy) == before


def test_ls_lists_an_edited_recording_as_unreadable_beside_the_good_ones(
    recording: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "good.sqlite").write_bytes(recording.read_bytes())
    bad = _edited(recording, runs, "bad", "UPDATE meta SET value = 'abc' WHERE key = 'started_at'")
    os.utime(bad)  # the newest: what `last` names
    env = {**os.environ, "TORCHDOCTOR_RUNS_DIR": str(runs)}
    res = run_td("ls", "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    import json

    status = {r["name"]: r["status"] for r in json.loads(res.stdout)["recordings"]}
    assert status == {"good.sqlite": "exit 0", "bad.sqlite": "unreadable"}
    _one_line(run_td("show", "last", env=env), "bad.sqlite' is damaged or edited")


def test_diagnose_says_it_is_incomplete_when_rules_failed(recording: Path, tmp_path: Path) -> None:
    # a figure every CPU rule reads, NULL in every sample: the rules that read it fail
    copy = _edited(recording, tmp_path, "nulls", "UPDATE host_samples SET cpu_busy = NULL")
    res = run_td("diagnose", str(copy))
    assert res.returncode == 0, res.stderr
    assert "no problems found in this job" not in res.stdout
    if "failed on this recording and was skipped" in res.stderr:
        assert "the diagnosis is incomplete" in res.stdout


def test_diagnose_blames_the_file_that_is_no_recording(recording: Path, tmp_path: Path) -> None:
    noise = tmp_path / "random.sqlite"
    noise.write_bytes(os.urandom(50_000))
    res = run_td("diagnose", str(recording), str(noise))
    _one_line(res, "random.sqlite' is not a torchdoctor recording")


def test_run_with_a_name_too_long_for_the_file_system_is_one_line(tmp_path: Path) -> None:
    res = run_td("run", "--out", "x" * 300 + ".sqlite", "--", "true", cwd=tmp_path)
    _one_line(res, "File name too long", "--out")


@pytest.mark.parametrize("command", [["show"], ["diagnose"]])
def test_a_profile_table_that_lost_a_column_is_one_line(
    recording: Path, tmp_path: Path, command: list[str]
) -> None:
    """Found by the fuzz suite: every profile rule failed apart (six 'failed and was skipped'
    lines) before the one error; a profile table without its columns is an edited file."""
    sql = (
        "DROP TABLE profile_windows;"
        "CREATE TABLE profile_windows (id INTEGER PRIMARY KEY, rank INTEGER, pid INTEGER);"
        "INSERT INTO profile_windows VALUES (1, 0, 1)"
    )
    copy = _edited(recording, tmp_path, "profile-column-lost", sql)
    before = _digest(copy)
    res = run_td(*command, str(copy), cwd=tmp_path)
    _one_line(res, "is damaged or edited", "no such column")
    assert _digest(copy) == before
