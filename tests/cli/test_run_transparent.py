"""`run` is transparent: whatever happens to torchdoctor's own output (a reader that had enough,
a full disk, a closed stream), the job's exit status and output are its own; and the lines
torchdoctor adds stay where they belong (the JSON on a line of its own, the header on one line).
Also: readers (`show`, `diagnose`) into a closed pipe, and `attach` stopped by the user."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TORCHDOCTOR, run_td
from torchdoctor import open_recording

PY = sys.executable


def _closed_pipe() -> int:
    """The write end of a pipe nobody reads: every write to it fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def test_a_reader_that_had_enough_does_not_change_the_exit_status(tmp_path: Path) -> None:
    """`torchdoctor run -- job 2>&1 | head -1`: the end report meets a closed pipe."""
    proc = subprocess.Popen(
        [*TORCHDOCTOR, "run", "--out", str(tmp_path / "r.sqlite"), "--",
         PY, "-c", "import sys; sys.stdin.read(); sys.exit(3)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert b"torchdoctor: recording" in proc.stdout.readline()  # what `head -1` reads
    proc.stdout.close()  # `head` exits
    proc.stdin.close()  # the job ends now, after the reader went away
    assert proc.wait(timeout=60) == 3
    with open_recording(tmp_path / "r.sqlite") as rec:
        assert rec.meta["exit_status"] == 3


@pytest.mark.skipif(
    not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)),
    reason="needs /dev/full",
)
def test_stderr_on_a_full_disk_does_not_change_the_exit_status(tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        res = subprocess.run(
            [*TORCHDOCTOR, "run", "--out", str(tmp_path / "r.sqlite"), "--",
             PY, "-c", "import sys; print('job out'); sys.exit(5)"],
            stdout=subprocess.PIPE, stderr=full, text=True, timeout=120,
        )  # fmt: skip
    assert (res.returncode, res.stdout) == (5, "job out\n")


def test_json_into_a_closed_pipe_keeps_the_status_and_says_nothing(tmp_path: Path) -> None:
    write_end = _closed_pipe()
    res = subprocess.run(
        [*TORCHDOCTOR, "run", "--json", "--quiet", "--out", str(tmp_path / "r.sqlite"), "--",
         PY, "-c", "import sys; sys.exit(6)"],
        stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
    )  # fmt: skip
    os.close(write_end)
    assert (res.returncode, res.stderr) == (6, "")


def test_with_stderr_closed_the_report_stays_out_of_the_jobs_output(tmp_path: Path) -> None:
    """`2>&-`: Python has no sys.stderr, and rich would have printed the report on stdout."""
    res = subprocess.run(
        ["sh", "-c", 'exec "$@" 2>&-', "sh", *TORCHDOCTOR, "run",
         "--out", str(tmp_path / "r.sqlite"), "--",
         PY, "-c", "import sys; print('job out'); sys.exit(4)"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (res.returncode, res.stdout) == (4, "job out\n")


@pytest.mark.parametrize("command", ["show", "diagnose"])
def test_readers_into_a_closed_pipe_exit_as_they_would_have(tmp_path: Path, command) -> None:
    """`torchdoctor show R | head -1`: a reader that had enough is no error of ours."""
    rec = tmp_path / "r.sqlite"
    assert run_td("run", "--quiet", "--out", str(rec), "--", PY, "-c", "pass").returncode == 0
    expected = run_td(command, str(rec))
    assert expected.stdout  # something to write into the closed pipe
    write_end = _closed_pipe()
    res = subprocess.run(
        [*TORCHDOCTOR, command, str(rec)],
        stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
    )  # fmt: skip
    os.close(write_end)
    assert (res.returncode, res.stderr) == (expected.returncode, expected.stderr)


def test_json_starts_on_a_new_line_after_output_without_one(tmp_path: Path) -> None:
    res = run_td(
        "run", "--json", "--quiet", "--out", str(tmp_path / "r.sqlite"), "--",
        PY, "-c", "import sys; sys.stdout.write('no newline at end')",
    )  # fmt: skip
    assert res.returncode == 0
    job_output, last_line = res.stdout.rstrip("\n").rsplit("\n", 1)
    assert job_output == "no newline at end"
    assert json.loads(last_line)["exit_status"] == 0  # what `tail -n 1` reads


def test_json_into_a_file_adds_no_blank_line(tmp_path: Path) -> None:
    """A file can be read back: after output that ends a line, the JSON follows directly."""
    out = tmp_path / "out.txt"
    with out.open("w") as fh:
        res = subprocess.run(
            [*TORCHDOCTOR, "run", "--json", "--quiet", "--out", str(tmp_path / "r.sqlite"),
             "--", PY, "-c", "print('a line')"],
            stdout=fh, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    assert res.returncode == 0
    first, second = out.read_text().splitlines()
    assert first == "a line" and json.loads(second)["exit_status"] == 0


def test_the_header_shows_the_command_on_one_line_cut_at_a_word(tmp_path: Path) -> None:
    code = "import sys\nprint('first')\n" + "x = 1; " * 20
    rec = tmp_path / "r.sqlite"
    res = run_td("run", "--out", str(rec), "--", PY, "-c", code)
    header = res.stderr.splitlines()[0]
    assert header.startswith(f"torchdoctor: recording {PY} -c 'import sys\\nprint(")
    shown, rest = header.removeprefix("torchdoctor: recording ").split("...", 1)
    assert rest == f" into {rec}"
    whole = shlex.join([PY, "-c", code]).replace("\n", "\\n")
    assert whole.startswith(shown) and whole[len(shown)] == " "  # cut between two words


@pytest.mark.parametrize("name", ["nl\nname.sqlite", "tab\tname.sqlite", "esc\x1bname.sqlite"])
def test_out_with_a_control_character_is_refused(tmp_path: Path, name: str) -> None:
    res = run_td("run", "--out", str(tmp_path / name), "--", PY, "-c", "pass")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "newline or control character" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_attach_stopped_by_the_user_does_not_say_the_job_ended(tmp_path: Path) -> None:
    job = subprocess.Popen(
        [PY, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert job.stdout.readline() == "ready\n"
    rec = tmp_path / "a.sqlite"
    attach = subprocess.Popen(
        [*TORCHDOCTOR, "attach", str(job.pid), "--interval", "0.1", "--out", str(rec)],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert "recording PID" in attach.stderr.readline()
    # The next line (how the job's steps are seen, or why not) comes once Ctrl-C stops us.
    attach.stderr.readline()
    attach.send_signal(signal.SIGINT)
    _, err = attach.communicate(timeout=60)
    assert attach.returncode == 0
    assert "recording stopped by the user (SIGINT) while the job still ran" in err
    assert " ended " not in err
    assert job.poll() is None  # still running, unharmed
    job.stdin.close()
    assert job.wait(timeout=30) == 0
    with open_recording(rec) as r:
        assert r.meta["stopped_by_signal"] == signal.SIGINT


class _FullDisk(io.StringIO):
    """A stream on a full disk: every write fails with ENOSPC; counts the attempts."""

    attempts = 0

    def write(self, text: str) -> int:
        self.attempts += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_the_end_report_stops_at_a_broken_stream(tmp_path: Path) -> None:
    """A report line that failed is not followed by a line about it into the same stream
    (which raised again, out of the courtesy meant never to fail the run), and a closed pipe
    does not end the process (rich's own answer is SystemExit(1))."""
    from torchdoctor.run.end_report import print_end_report
    from torchdoctor.terminal import make_console

    rec = tmp_path / "r.sqlite"
    assert run_td("run", "--quiet", "--out", str(rec), "--", PY, "-c", "pass").returncode == 0
    full = _FullDisk()
    assert print_end_report(rec, make_console(full), None) is None
    assert full.attempts == 1
    broken = open(_closed_pipe(), "w")  # noqa: SIM115 - its close fails: what it holds is lost
    summary, findings = print_end_report(rec, make_console(broken), None)
    assert summary.exit_status == 0  # figured out all the same, for `run --json`
    with contextlib.suppress(BrokenPipeError):
        broken.close()


def test_streams_without_a_descriptor_are_kept(capsys) -> None:
    """Run in-process under a capture (no descriptor to copy), the output is still captured."""
    from torchdoctor.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert "torchdoctor" in capsys.readouterr().out


def test_launch_into_a_closed_pipe_exits_with_torchruns_status(tmp_path: Path) -> None:
    """`launch` passes torchrun's status through like `run`, whatever its stderr meets."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")  # a job writing into the closed pipe would fail itself
    argv = [*TORCHDOCTOR, "launch", "--nproc-per-node", "1", "--out-dir", str(tmp_path / "runs")]
    expected = subprocess.run([*argv, "--", str(script)], capture_output=True, timeout=300)
    assert expected.returncode == 0, expected.stderr
    write_end = _closed_pipe()
    res = subprocess.run(
        [*argv, "--", str(script)], stdout=write_end, stderr=write_end, timeout=300
    )
    os.close(write_end)
    assert res.returncode == expected.returncode
