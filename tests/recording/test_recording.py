"""The recording file: readable back, refuses what it cannot read, exports every table."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.helpers.machine_gpus import machine_gpus
from torchdoctor import open_recording
from torchdoctor.errors import NotARecordingError, UserError

PY = sys.executable
# Holds 30 MiB for at least 0.6 s, and until the recording (its path is argv[1]) holds 3
# samples of it doing so: a loaded machine may delay the recorder, never starve the test.
JOB = """\
import os, sqlite3, sys, time
x = [bytearray(1 << 20) for _ in range(30)]
time.sleep(0.6)
query = "SELECT COUNT(*) FROM process_samples WHERE pid = ? AND rss > ?"
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        db = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
        try:
            if db.execute(query, (os.getpid(), 30 << 20)).fetchone()[0] >= 3:
                break
        finally:
            db.close()
    except sqlite3.Error:
        pass  # not created or flushed yet
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rec") / "job.sqlite"
    res = run_td(
        "run", "--quiet", "--interval", "0.1", "--out", str(path), "--", PY, "-c", JOB, str(path)
    )
    assert res.returncode == 0, res.stderr
    return path


def test_show_json_summarizes_the_job(recording: Path) -> None:
    res = run_td("show", "--json", str(recording))
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["command"] == [PY, "-c", JOB, str(recording)]
    assert summary["exit_status"] == 0 and summary["complete"] is True
    assert 0.5 < summary["duration_s"] < 60
    assert summary["samples"] >= 3
    # the job held 30 MiB of its own on top of the interpreter
    assert summary["job_rss"]["peak"] > 30 * 2**20
    assert summary["roles"] == {"trainer": 1}
    # what the machine has: "unavailable, why" here; every device NVML sees on a GPU machine
    if machine_gpus().available:
        assert summary["gpu_unavailable"] is None and len(summary["gpus"]) == len(
            machine_gpus().gpus
        )
    else:
        assert summary["gpu_unavailable"] and summary["gpus"] == []


def test_show_prints_a_readable_summary(recording: Path) -> None:
    res = run_td("show", str(recording))
    assert res.returncode == 0
    assert "job RSS (sum)" in res.stdout and "MiB" in res.stdout
    assert f"recording: {recording}" in res.stdout


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_export_writes_every_non_empty_table(recording: Path, tmp_path: Path, fmt: str) -> None:
    res = run_td("export", str(recording), "--format", fmt, "--out-dir", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    files = {Path(line).name for line in res.stdout.split()}
    assert {
        "meta.json",
        f"host_samples.{fmt}",
        f"process_samples.{fmt}",
        f"processes.{fmt}",
    } <= files
    with open_recording(recording) as rec:
        expected = rec.count("process_samples")
    path = tmp_path / "out" / f"process_samples.{fmt}"
    if fmt == "csv":
        import csv

        rows = list(csv.DictReader(path.open()))
        assert int(rows[0]["rss"]) > 0
    elif fmt == "jsonl":
        rows = [json.loads(line) for line in path.open()]
        assert isinstance(rows[0]["unavailable"], dict)
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    assert len(rows) == expected


def test_not_a_recording(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(NotARecordingError, match="not a torchdoctor recording"):
        open_recording(text)
    other = tmp_path / "other.sqlite"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    res = run_td("show", str(other))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"torchdoctor: error: {str(other)!r} is a SQLite file but not a torchdoctor recording; "
        "recordings are written by `torchdoctor run`"
    ]


def test_recording_from_a_newer_schema_is_refused_clearly(recording: Path, tmp_path: Path) -> None:
    newer = tmp_path / "newer.sqlite"
    newer.write_bytes(recording.read_bytes())
    db = sqlite3.connect(newer)
    db.execute("PRAGMA user_version=99")
    db.close()
    res = run_td("show", str(newer))
    assert res.returncode == 2
    line = res.stderr.strip()
    assert (
        "comes from a newer torchdoctor (schema 99" in line and "pip install -U torchdoctor" in line
    )
    assert newer.read_bytes()[:16] == b"SQLite format 3\x00"  # left as it was


def test_missing_file() -> None:
    res = run_td("show", "/nonexistent/x.sqlite")
    assert res.returncode == 2
    assert res.stderr.strip() == "torchdoctor: error: no such file: '/nonexistent/x.sqlite'"


def test_reader_api_rejects_unknown_tables_and_columns(recording: Path) -> None:
    with open_recording(recording) as rec:
        with pytest.raises(UserError, match="unknown table"):
            rec.rows("nope")
        with pytest.raises(UserError, match="has no column"):
            rec.rows("host_samples", columns=["nope"])
        cpu = rec.rows("host_samples", columns=["t", "cpu_busy"])
        assert list(cpu[0]) == ["t", "cpu_busy"]
        assert [r["t"] for r in cpu] == sorted(r["t"] for r in cpu)
