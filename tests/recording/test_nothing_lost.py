"""Nothing lost when runs overlap, get copied mid-run, are cut in half, or fill the disk."""

from __future__ import annotations

import multiprocessing
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TORCHDOCTOR, run_td
from tests.helpers.bad_input import small_tmpfs
from tests.helpers.engines import engine, not_root
from torchdoctor import open_recording
from torchdoctor.errors import UserError
from torchdoctor.recording import claim_recording_file, create_recording_file

PY = sys.executable
# Prints its PID, then lives until its stdin closes: the test decides when the jobs end, so
# that all of them are surely running (and sampled) at the same time.
WAIT_JOB = "import os, sys; print(os.getpid(), flush=True); sys.stdin.read()"
# 20 sleeping children: a recording that grows quickly, as a multi-process job's does.
TREE_JOB = (
    "import subprocess, sys\n"
    "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    " for _ in range(20)]\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
    "for k in kids: k.kill()\n"
    "for k in kids: k.wait()\n"
)


def _wait_for(condition, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)  # polling a file another process writes: there is no event to wait on


def _count(path: Path, table: str = "host_samples") -> int:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def _create_in(folder: str, now: float, queue) -> None:
    queue.put(str(create_recording_file("python-train", folder=folder, now=now)))


def test_same_name_same_second_from_many_processes_gives_distinct_files(tmp_path: Path) -> None:
    # The same second for all: the name alone cannot tell them apart, the create must.
    now = time.time()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_create_in, args=(str(tmp_path), now, queue)) for _ in range(8)]
    for p in procs:
        p.start()
    names = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    assert len(set(names)) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(n).name for n in names)
    with pytest.raises(UserError, match="already exists"):
        claim_recording_file(names[0])


def test_eight_runs_started_together_write_eight_recordings(tmp_path: Path) -> None:
    runs = [
        subprocess.Popen(
            [*TORCHDOCTOR, "run", "--quiet", "--interval", "0.1", "--", PY, "-c", WAIT_JOB],
            cwd=tmp_path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    try:
        pids = [int(r.stdout.readline()) for r in runs]
        folder = tmp_path / "torchdoctor-runs"
        # Every job sampled at least twice while all eight run.
        _wait_for(
            lambda: (
                all(_count(f, "process_samples") >= 2 for f in folder.glob("*.sqlite"))
                and len(list(folder.glob("*.sqlite"))) == 8
            )
        )
    finally:
        for r in runs:
            r.stdin.close()
        outcomes = [r.wait(120) for r in runs]
    assert outcomes == [0] * 8, [r.stderr.read() for r in runs]
    files = sorted(folder.glob("*.sqlite"))
    assert len(files) == 8
    owners = []
    for f in files:
        with open_recording(f) as rec:
            assert rec.complete
            sampled = {r["pid"] for r in rec.query("SELECT DISTINCT pid FROM process_samples")}
            assert sampled == {rec.meta["root_pid"]}, f"{f.name} holds another job's samples"
            owners.append(rec.meta["root_pid"])
    assert sorted(owners) == sorted(pids)


def test_a_live_recording_is_in_progress_and_a_copy_without_its_wal_opens(tmp_path: Path) -> None:
    rec = tmp_path / "live.sqlite"
    run = subprocess.Popen(
        [*TORCHDOCTOR, "run", "--quiet", "--interval", "0.05", "--out", str(rec), "--",
         PY, "-c", WAIT_JOB],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        run.stdout.readline()
        _wait_for(lambda: _count(rec) >= 3)
        assert Path(f"{rec}-wal").exists()

        shown = run_td("show", str(rec))
        assert shown.returncode == 0, shown.stderr
        assert "recording in progress (pid " in shown.stdout
        assert "last write" in shown.stdout and "cut short" not in shown.stdout
        diagnosed = run_td("diagnose", str(rec))
        assert diagnosed.returncode == 0, diagnosed.stderr
        assert "recording in progress" in diagnosed.stdout

        # A copy of the .sqlite alone, as `cp` or `scp` of a running job's file gives.
        early = tmp_path / "early.sqlite"
        shutil.copyfile(rec, early)
        with open_recording(early) as copy:
            assert copy.meta["command"][-1] == WAIT_JOB  # the main file is a recording at once
            assert copy.state.wal_missing
        shown = run_td("show", str(early))
        assert shown.returncode == 0, shown.stderr
        assert "copy early.sqlite-wal along, or wait 10 s and copy again" in shown.stdout

        # After a checkpoint (every 10 s) the main file alone holds the samples.
        late = tmp_path / "late.sqlite"

        def copy_holds_samples() -> bool:
            shutil.copyfile(rec, late)
            return _count(late) > 0

        _wait_for(copy_holds_samples, timeout=120)
        with open_recording(late) as copy:
            assert copy.count("host_samples") > 0 and copy.count("process_samples") > 0
            assert not copy.damage
    finally:
        run.stdin.close()
        assert run.wait(120) == 0
    shown = run_td("show", str(rec))
    assert "exit status 0" in shown.stdout and "in progress" not in shown.stdout


def test_a_recording_cut_in_half_shows_its_intact_part(tmp_path: Path) -> None:
    full = tmp_path / "full.sqlite"
    run = subprocess.Popen(
        [*TORCHDOCTOR, "run", "--quiet", "--interval", "0.05", "--out", str(full), "--",
         PY, "-c", TREE_JOB],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert run.stdout.readline() == "ready\n"
        _wait_for(lambda: _count(full) >= 150, timeout=120)
    finally:
        run.stdin.close()
        assert run.wait(120) == 0
    with open_recording(full) as rec:
        all_host, all_procs = rec.count("host_samples"), rec.count("process_samples")
    half = tmp_path / "half.sqlite"
    data = full.read_bytes()
    half.write_bytes(data[: len(data) // 2 + 100])  # mid-page, as a copy cut short is

    with open_recording(half) as rec:
        kept_host, kept_procs = rec.count("host_samples"), rec.count("process_samples")
        assert rec.damage[0].startswith("recording damaged (the file holds ")
        assert any(line.startswith("host_samples: ") and "lost" in line for line in rec.damage)
        assert rec.meta["exit_status"] == 0  # the metadata sits at the front of the file
    assert 0 < kept_host < all_host and 0 < kept_procs < all_procs

    shown = run_td("show", str(half))
    assert shown.returncode == 0, shown.stderr
    assert "recording damaged" in shown.stdout and f"{kept_host} samples" in shown.stdout
    assert "malformed" not in shown.stdout + shown.stderr
    diagnosed = run_td("diagnose", str(half))
    assert diagnosed.returncode == 0, diagnosed.stderr
    assert "recording damaged" in diagnosed.stdout
    exported = run_td("export", str(half), "--format", "csv", "--out-dir", str(tmp_path / "csv"))
    assert exported.returncode == 0, exported.stderr
    lines = (tmp_path / "csv" / "host_samples.csv").read_text().splitlines()
    assert len(lines) == kept_host + 1, (len(lines), kept_host)  # the header, then each row
    report = run_td("report", str(half), "--out", str(tmp_path / "half.html"))
    assert report.returncode == 0, report.stderr
    assert "recording damaged" in (tmp_path / "half.html").read_text()


FILLER_JOB = """\
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(10)]
print("job output line 1", flush=True)
deadline = time.monotonic() + 8
while time.monotonic() < deadline:
    time.sleep(0.1)
for k in kids:
    k.kill()
    k.wait()
print("job output line 2", flush=True)
sys.exit(3)
"""


@engine("root", not_root())  # mounting a small tmpfs
def test_a_full_disk_stops_the_recording_with_one_line_and_spares_the_job(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "256k") as small:
        res = run_td(
            "run", "--interval", "0.05", "--out", str(small / "r.sqlite"), "--",
            PY, "-c", FILLER_JOB,
            timeout=180,
        )  # fmt: skip
    assert res.returncode == 3
    assert res.stdout == "job output line 1\njob output line 2\n"
    expected = f"torchdoctor: recording stopped: no space left on {small} (free "
    assert res.stderr.count(expected) == 1, res.stderr
    assert "the job keeps running; free space or pass --out elsewhere" in res.stderr
    assert res.stderr.count("recording stopped") == 1
    assert "internal error" not in res.stderr
    assert "recording cut short (the recorder stopped before the job ended" in res.stderr


def test_a_torn_json_cell_of_a_salvaged_page_reads_as_unknown():
    # A page salvaged from a file cut mid-way can end inside a JSON cell: that one value is
    # unknown, the row and the rest of the table still read (export met one such cell).
    from torchdoctor.recording.schema import TABLES, from_row

    table = TABLES["host_samples"]
    json_cols = [c.name for c in table.columns if c.kind == "json"]
    assert json_cols
    row = {c.name: None for c in table.columns}
    row.update({"t": 1.0, json_cols[0]: '{"user": 1.0, "sys'})
    decoded = from_row(table, row)
    assert decoded["t"] == 1.0 and decoded[json_cols[0]] is None
