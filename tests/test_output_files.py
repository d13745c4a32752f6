"""The one writer of files the user names (torchdoctor.output_files), and every command that
writes one through it: `report -o`, `export --out-dir`, `estimate --memory-snapshot`
(`sbatch -o`: tests/slurm/test_sbatch_input.py).

Devices are copies made with mknod in the test's own folder, never the machine's /dev (the
probe that found H1 replaced the VM's /dev/full with an HTML file)."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.bad_input import one_error_line, record_short_job, small_tmpfs
from tests.helpers.engines import not_root, require_engine
from torchdoctor.errors import ParameterError, UserError
from torchdoctor.output_files import (
    RECORDING_APPLICATION_ID,
    check_output_file,
    open_output_file,
    write_output_file,
)
from torchdoctor.recording.schema import APPLICATION_ID


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    """A real recording of a short job."""
    return record_short_job(tmp_path_factory.mktemp("rec") / "job.sqlite")


@pytest.fixture
def null_device(tmp_path: Path) -> Path:
    """A character device like /dev/null (1, 3), made in the test's folder (needs root)."""
    require_engine("root", not_root())
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    node.chmod(0o666)  # mknod applies the umask; /dev/null is rw for everyone
    return node


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: a disk that fills up (needs root and mount)."""
    with small_tmpfs(tmp_path / "small", "64k") as folder:
        yield folder


# -- the writer itself --------------------------------------------------------------------


def test_the_recording_marker_is_the_recordings_application_id() -> None:
    # The leaf cannot import the recording floor: the two constants must agree.
    assert RECORDING_APPLICATION_ID == APPLICATION_ID


def test_a_new_file_gets_the_mode_less_the_umask_and_no_temporary_is_left(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        written = write_output_file(tmp_path / "job.sbatch", "#!/bin/bash\n", "-o", mode=0o755)
    finally:
        os.umask(old)
    assert stat.S_IMODE(written.stat().st_mode) == 0o750
    assert [p.name for p in tmp_path.iterdir()] == ["job.sbatch"]


def test_an_existing_file_is_refused_then_replaced_with_force_keeping_its_mode(
    tmp_path: Path,
) -> None:
    mine = tmp_path / "mine.sh"
    mine.write_text("my own script\n")
    mine.chmod(0o600)
    with pytest.raises(UserError, match=r"-o '.*mine.sh' already exists; add --force"):
        write_output_file(mine, "new", "-o", mode=0o755)
    assert mine.read_text() == "my own script\n"
    write_output_file(mine, "new", "-o", force=True, mode=0o755)
    assert mine.read_text() == "new"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o600  # never chmodded: not created here


def test_a_file_the_command_wrote_itself_is_replaced_without_force(tmp_path: Path) -> None:
    target = tmp_path / "r.html"
    target.write_text("OURS v1")
    write_output_file(target, "OURS v2", "-o", ours=lambda head: head.startswith(b"OURS"))
    assert target.read_text() == "OURS v2"


def test_a_recording_is_never_replaced_even_with_force(recording: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.sqlite"
    victim.write_bytes(recording.read_bytes())
    before = digest(victim)
    with pytest.raises(UserError, match="is a torchdoctor recording, which is never replaced"):
        write_output_file(victim, "<html>", "-o", force=True)
    assert digest(victim) == before


def test_a_symlink_is_written_through(tmp_path: Path) -> None:
    target = tmp_path / "target.html"
    target.write_text("old")
    link = tmp_path / "link.html"
    link.symlink_to(target.name)
    write_output_file(link, "new", "-o", force=True)
    assert link.is_symlink() and os.readlink(link) == "target.html"
    assert target.read_text() == "new"


def test_a_symlink_to_a_recording_is_refused(recording: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.html"
    link.symlink_to(recording)
    with pytest.raises(UserError, match="is a torchdoctor recording"):
        write_output_file(link, "new", "-o", force=True)


def test_a_fifo_and_a_folder_are_refused_with_force(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=r"is a FIFO \(named pipe\), not a file"):
        write_output_file(fifo, "x", "-o", force=True)  # opened for reading it would hang
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    with pytest.raises(UserError, match="is a folder, not a file"):
        write_output_file(tmp_path, "x", "-o", force=True)


def test_a_device_is_refused_and_left_as_it_was(null_device: Path) -> None:
    with pytest.raises(UserError, match="is a character device, not a file"):
        write_output_file(null_device, "x", "-o", force=True, mode=0o755)
    st = null_device.stat()
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666


def test_a_missing_folder_and_a_parent_that_is_a_file_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="the folder '.*nowhere' does not exist"):
        check_output_file(tmp_path / "nowhere" / "r.html", "-o")
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match="'.*afile' is a file, not a folder"):
        check_output_file(tmp_path / "afile" / "x", "-o")


def test_a_failure_while_writing_leaves_the_old_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "r.html"
    target.write_text("old")
    with pytest.raises(RuntimeError), open_output_file(target, "-o", force=True) as fh:
        fh.write("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]


def test_a_full_disk_is_one_line_naming_the_option_and_leaves_nothing(small_disk: Path) -> None:
    with pytest.raises(UserError) as caught:
        write_output_file(small_disk / "big.html", "x" * 200_000, "-o")
    assert "No space left on device; free some space or choose another -o" in caught.value.message
    assert list(small_disk.iterdir()) == []


def test_a_library_parameter_is_reworded_as_the_flag(tmp_path: Path) -> None:
    (tmp_path / "s.pickle").write_bytes(b"mine")
    with pytest.raises(ParameterError) as caught:
        check_output_file(tmp_path / "s.pickle", "memory_snapshot")
    flagged = caught.value.worded({"memory_snapshot": "--memory-snapshot"}).message
    assert (
        flagged.startswith("--memory-snapshot '") and "choose another --memory-snapshot" in flagged
    )


def test_text_that_is_not_utf8_is_written_back_as_its_bytes(tmp_path: Path) -> None:
    name = os.fsdecode(b"caf\xe9.csv")  # a Latin-1 argv as Python holds it: a surrogate
    written = write_output_file(tmp_path / "s.sh", f"python train.py {name}\n", "-o")
    assert written.read_bytes() == b"python train.py caf\xe9.csv\n"


# -- report -o ----------------------------------------------------------------------------


def test_report_refuses_to_replace_another_recording(recording: Path, td, tmp_path: Path) -> None:
    victim = tmp_path / "t.sqlite"
    victim.write_bytes(recording.read_bytes())
    before = digest(victim)
    for extra in ([], ["--force"]):
        line = one_error_line(td("report", str(recording), "-o", str(victim), *extra))
        assert "is a torchdoctor recording, which is never replaced" in line
        assert digest(victim) == before


def test_report_refuses_a_users_file_unless_force(recording: Path, td, tmp_path: Path) -> None:
    notes = tmp_path / "notes.html"
    notes.write_text("my notes")
    line = one_error_line(td("report", str(recording), "-o", str(notes)))
    assert "already exists; add --force to replace it" in line
    assert notes.read_text() == "my notes"
    result = td("report", str(recording), "-o", str(notes), "--force")
    assert result.returncode == 0, result.stderr
    assert "<title>torchdoctor report: " in notes.read_text(encoding="utf-8")


def test_report_writes_through_a_symlink(recording: Path, td, tmp_path: Path) -> None:
    target = tmp_path / "target.html"
    target.write_text("old")
    link = tmp_path / "link.html"
    link.symlink_to(target)
    result = td("report", str(recording), "-o", str(link), "--force")
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and "<title>torchdoctor report: " in target.read_text("utf-8")


def test_report_onto_a_fifo_or_device_is_refused(
    recording: Path, td, tmp_path: Path, null_device: Path
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for node, kind in ((fifo, "a FIFO"), (null_device, "a character device")):
        line = one_error_line(td("report", str(recording), "-o", str(node), "--force"))
        assert f"is {kind}" in line
    assert stat.S_ISCHR(null_device.stat().st_mode) and stat.S_ISFIFO(fifo.stat().st_mode)


def test_report_of_a_command_with_non_utf8_bytes(td, tmp_path: Path) -> None:
    # M1: `run -- python -c ... $'caf\xe9.csv'` recorded fine, and report crashed writing it.
    path = tmp_path / "lat.sqlite"
    latin1 = os.fsdecode(b"caf\xe9.csv")
    code = "import sys; print(len(sys.argv))"
    res = td("run", "--quiet", "--out", str(path), "--", sys.executable, "-c", code, latin1)
    assert res.returncode == 0, res.stderr
    result = td("report", str(path))
    assert result.returncode == 0, result.stderr
    assert "caf\\udce9.csv" in path.with_suffix(".html").read_text(encoding="utf-8")


# -- export --out-dir ---------------------------------------------------------------------


def test_export_refuses_the_users_files_then_replaces_them_with_force(
    recording: Path, td, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "meta.json").write_text("my meta")
    line = one_error_line(td("export", str(recording), "--format", "csv", "--out-dir", str(out)))
    assert "--out-dir" in line and "meta.json' already exists; add --force" in line
    assert [p.name for p in out.iterdir()] == ["meta.json"]  # nothing written beside it
    assert (out / "meta.json").read_text() == "my meta"
    result = td("export", str(recording), "--format", "csv", "--out-dir", str(out), "--force")
    assert result.returncode == 0, result.stderr
    assert (out / "meta.json").read_text().startswith("{")


def test_export_onto_a_full_disk_leaves_no_half_folder(
    recording: Path, td, small_disk: Path
) -> None:
    # The disk full to the last block (unbuffered: nothing left to flush at close).
    with open(small_disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:
            filler.write(b"\0" * 4096)
    out = small_disk / "x"
    line = one_error_line(td("export", str(recording), "--format", "csv", "--out-dir", str(out)))
    assert "No space left on device; free some space or choose another --out-dir" in line
    assert not out.exists()


# -- estimate --memory-snapshot -----------------------------------------------------------


def test_memory_snapshot_refuses_a_recording_before_tracing(recording: Path, td, tmp_path) -> None:
    victim = tmp_path / "victim.sqlite"
    victim.write_bytes(recording.read_bytes())
    before = digest(victim)
    # The spec does not exist: the refusal comes first, before any model is loaded.
    args = ("estimate", "nosuch.py:make", "--input", "8", "--memory-snapshot", str(victim))
    line = one_error_line(td(*args, "--force"))
    assert line.startswith("torchdoctor: error: --memory-snapshot '") and "recording" in line
    assert digest(victim) == before
    mine = tmp_path / "mine.pickle"
    mine.write_bytes(b"mine")
    line = one_error_line(td(*args[:-1], str(mine)))
    assert "already exists; add --force" in line


# -- queue install --dir ------------------------------------------------------------------


def test_queue_install_refuses_a_masked_unit_and_leaves_dev_null_alone(
    td, tmp_path: Path, null_device: Path
) -> None:
    # `systemctl mask` makes the unit a symlink to /dev/null: writing through it and chmodding
    # it made /dev/null 0644 (here a copy of it).
    units = tmp_path / "units"
    units.mkdir()
    (units / "torchdoctor-queue.service").symlink_to(null_device)
    line = one_error_line(td("queue", "install", "--dir", str(units)))
    assert "torchdoctor-queue.service' is a character device, not a file" in line
    st = null_device.stat()
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666
    (units / "torchdoctor-queue.service").unlink()
    done = td("queue", "install", "--dir", str(units))
    assert done.returncode == 0, done.stderr
    done = td("queue", "install", "--dir", str(units))  # installing again replaces them
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in units.iterdir()) == [
        "torchdoctor-exporter.service",
        "torchdoctor-queue.service",
    ]


def test_a_sqlite_file_with_its_wal_beside_it_is_not_replaced(tmp_path: Path) -> None:
    import sqlite3

    db_path = tmp_path / "live.sqlite"
    db = sqlite3.connect(db_path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (x)")
    db.execute("INSERT INTO t VALUES (1)")
    db.commit()  # open: its -wal stays beside it
    try:
        assert (tmp_path / "live.sqlite-wal").exists()
        with pytest.raises(UserError, match="never replaced"):
            write_output_file(db_path, "x", "-o", force=True)
    finally:
        db.close()
