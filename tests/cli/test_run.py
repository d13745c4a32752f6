"""`torchdoctor run`: the job runs exactly as without us, and everything lands in the recording."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, TORCHDOCTOR, run_td
from tests.helpers.machine_gpus import assert_gpu_status_matches
from torchdoctor import open_recording

PY = sys.executable


def test_exit_status_and_stdio_pass_through(tmp_path: Path) -> None:
    rec = tmp_path / "r.sqlite"
    script = "import sys; data = sys.stdin.read(); sys.stdout.write(data.upper()); sys.exit(3)"
    res = run_td(
        "run", "--quiet", "--out", str(rec), "--", PY, "-c", script, input="hello\nworld\n"
    )
    assert res.returncode == 3
    assert res.stdout == "HELLO\nWORLD\n"  # byte for byte: nothing of ours on stdout
    assert res.stderr == ""  # --quiet
    with open_recording(rec) as r:
        assert r.meta["exit_status"] == 3
        assert r.meta["command"] == [PY, "-c", script]


def test_status_is_128_plus_signal_when_a_signal_ends_the_command(tmp_path: Path) -> None:
    res = run_td(
        "run", "--quiet", "--out", str(tmp_path / "r.sqlite"), "--",
        PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    )  # fmt: skip
    assert res.returncode == 128 + signal.SIGTERM


# The signals are blocked before "ready" and then waited for: with a handler and pause(), a
# signal landing between the print and pause() would run the handler too late and the child
# would pause forever.
SIGNAL_CHILD = textwrap.dedent(
    """
    import signal, sys
    wanted = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
              signal.SIGUSR1, signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    print("ready", flush=True)
    signum = signal.sigwait(wanted)
    print(f"child got {signal.Signals(signum).name}", flush=True)
    sys.exit(7)
    """
)


@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2],
)
def test_signals_sent_to_torchdoctor_reach_the_command(tmp_path: Path, sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [
            *TORCHDOCTOR,
            "run",
            "--quiet",
            "--out",
            str(tmp_path / "r.sqlite"),
            "--",
            PY,
            "-c",
            SIGNAL_CHILD,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert out == f"child got {sig.name}\n"
    assert proc.returncode == 7


def test_ctrl_c_at_a_terminal_reaches_the_command_once(tmp_path: Path) -> None:
    """The tty sends SIGINT to the whole foreground group: forwarding it again would double it."""
    child = textwrap.dedent(
        """
        import signal, time
        # Blocked, then waited for: no window where a Ctrl-C could slip past a pause().
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        print("ready", flush=True)
        signal.sigwaitinfo({signal.SIGINT})
        hits = 1
        # give a duplicate SIGINT the time to arrive before reporting the count
        deadline = time.monotonic() + 1.0
        while (left := deadline - time.monotonic()) > 0:
            if signal.sigtimedwait({signal.SIGINT}, left) is not None:
                hits += 1
        print(f"interrupts: {hits}", flush=True)
        """
    )
    master, slave = os.openpty()

    def make_controlling_tty() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [
            *TORCHDOCTOR,
            "run",
            "--quiet",
            "--out",
            str(tmp_path / "r.sqlite"),
            "--",
            PY,
            "-c",
            child,
        ],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=make_controlling_tty,
    )
    os.close(slave)
    output = _read_until(master, b"ready")
    os.write(master, b"\x03")  # Ctrl-C, as typed
    output += _read_until(master, b"interrupts:", tail=True)
    assert proc.wait(timeout=60) == 0
    os.close(master)
    assert b"interrupts: 1" in output


def _read_until(fd: int, marker: bytes, tail: bool = False) -> bytes:
    buf = b""
    while marker not in buf or (tail and not buf.endswith(b"\n")):
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        buf += chunk
    return buf


def test_command_not_found_is_127_and_writes_nothing(tmp_path: Path) -> None:
    res = run_td("run", "--", "no-such-command-xyz", cwd=tmp_path)
    assert res.returncode == 127
    assert res.stderr.strip().splitlines() == [
        "torchdoctor: error: command not found: no-such-command-xyz (is it installed and on PATH?)"
    ]
    assert not (tmp_path / "torchdoctor-runs").exists()


def test_not_executable_is_126(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("echo hi\n")
    res = run_td("run", "--", str(script), cwd=tmp_path)
    assert res.returncode == 126
    assert len(res.stderr.strip().splitlines()) == 1
    assert "not executable" in res.stderr
    assert not (tmp_path / "torchdoctor-runs").exists()


@pytest.mark.parametrize(
    ("command", "status", "line"),
    [
        ("", 127, "empty command (''): the first word after `--` is the program to run"),
        (" ", 127, "empty command (' '): the first word after `--` is the program to run"),
        # was "command is not executable: /tmp (check its permissions)"
        ("/tmp", 126, "/tmp is a folder, not a command"),
    ],
)
def test_a_command_that_names_nothing_runnable_says_what_it_is(tmp_path, command, status, line):
    res = run_td("run", "--", command, cwd=tmp_path)
    assert res.returncode == status
    assert len(res.stderr.strip().splitlines()) == 1 and line in res.stderr
    assert not (tmp_path / "torchdoctor-runs").exists()


def test_run_from_a_deleted_working_directory_runs_the_job(tmp_path: Path) -> None:
    # A shell left in a removed folder: the pyproject.toml lookup and the recording's cwd
    # raised FileNotFoundError before the job started.
    gone, out = tmp_path / "gone", tmp_path / "job.sqlite"
    gone.mkdir()
    res = subprocess.run(
        ["sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh", str(gone),
         *TORCHDOCTOR, "run", "--quiet", "--out", str(out), "--", PY, "-c", "print('job ran')"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout == "job ran\n"
    assert res.stderr == ""
    assert out.stat().st_size > 0


@pytest.mark.parametrize("interval", ["0.01", "61", "2m"])
def test_interval_out_of_range(tmp_path: Path, interval: str) -> None:
    res = run_td("run", "--interval", interval, "--", PY, "-c", "pass", cwd=tmp_path)
    assert res.returncode == 2
    seconds = {"2m": 120.0}.get(interval) or float(interval)
    assert res.stderr.strip().splitlines() == [
        f"torchdoctor: error: --interval {seconds:g} is out of range: use 0.05-60 seconds "
        "(e.g. 0.5, 2s or 250ms)"
    ]


def test_negative_interval_is_not_a_duration(tmp_path: Path) -> None:
    res = run_td("run", "--interval", "-1", "--", PY, "-c", "pass", cwd=tmp_path)
    assert res.returncode == 2
    assert "cannot read --interval '-1'" in res.stderr
    assert not (tmp_path / "torchdoctor-runs").exists()


def test_unwritable_output_folder(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = run_td("run", "--out", str(blocker / "r.sqlite"), "--", PY, "-c", "print('ran')")
    assert res.returncode == 2
    assert "ran" not in res.stdout  # the job is not started when we cannot record it
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot create the output folder" in lines[0]


def test_existing_output_file_is_not_overwritten(tmp_path: Path) -> None:
    target = tmp_path / "r.sqlite"
    target.write_bytes(b"precious")
    res = run_td("run", "--out", str(target), "--", PY, "-c", "pass")
    assert res.returncode == 2
    assert target.read_bytes() == b"precious"


def test_default_path_and_end_summary(tmp_path: Path) -> None:
    res = run_td("run", "--", PY, "-c", "print('hi')", cwd=tmp_path)
    assert res.returncode == 0
    assert res.stdout == "hi\n"
    files = list((tmp_path / "torchdoctor-runs").glob("*.sqlite"))
    assert len(files) == 1
    assert files[0].name.endswith(f"-{Path(PY).name}.sqlite")
    assert "recording: torchdoctor-runs/" in res.stderr
    assert "exit status 0" in res.stderr


def test_records_trainer_and_dataloader_workers_over_time(tmp_path: Path) -> None:
    rec = tmp_path / "r.sqlite"
    res = run_td(
        "run", "--quiet", "--interval", "0.1", "--out", str(rec), "--",
        PY, str(REPO / "examples" / "train.py"), "--steps", "12", "--num-workers", "2",
        timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    with open_recording(rec) as r:
        procs = r.processes()
        roles = sorted(p["role"] for p in procs)
        assert roles.count("dataloader-worker") == 2
        assert roles.count("trainer") == 1
        trainer = next(p for p in procs if p["role"] == "trainer")
        samples = r.rows("process_samples", where={"pid": trainer["pid"]})
        assert len(samples) >= 3  # a time series, not one reading
        assert max(s["rss"] for s in samples) > 50 * 2**20  # torch is loaded
        assert max(s["threads"] for s in samples) >= 2
        assert any(s["cpu_percent"] and s["cpu_percent"] > 10 for s in samples)
        workers = [p["pid"] for p in procs if p["role"] == "dataloader-worker"]
        worker_rows = r.query(
            f"SELECT COUNT(*) AS n FROM process_samples WHERE pid IN ({','.join('?' * len(workers))})",
            workers,
        )
        assert worker_rows[0]["n"] >= 2
        host = r.rows("host_samples")
        assert len(host) >= 3 and host[-1]["mem_total"] > 0
        assert r.meta["host"]["logical_cpus"] >= 1
        gpus = r.meta["gpus"]
        assert_gpu_status_matches(gpus["available"], gpus["reason"], len(gpus["gpus"]))


def test_recorder_killed_with_sigkill_leaves_a_readable_recording(tmp_path: Path) -> None:
    rec = tmp_path / "r.sqlite"
    job = "import sys; print('ready', flush=True); sys.stdin.read()"
    proc = subprocess.Popen(
        [
            *TORCHDOCTOR,
            "run",
            "--quiet",
            "--interval",
            "0.1",
            "--out",
            str(rec),
            "--",
            PY,
            "-c",
            job,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "ready\n"
    # Wait (bounded) until at least one flush has committed samples, then kill at once.
    _wait_for(lambda: _count_samples(rec) >= 5)
    job_pid = _job_pid(rec)
    proc.kill()
    proc.wait(timeout=30)
    try:
        with open_recording(rec) as r:
            assert not r.complete
            rows = r.rows("host_samples")
            assert len(rows) >= 5
            assert r.meta["root_pid"] == job_pid
    finally:
        # the job outlives its recorder, as it must; end it ourselves
        os.kill(job_pid, signal.SIGKILL)


def _count_samples(path: Path) -> int:
    import sqlite3

    if not path.exists():
        return 0
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return db.execute("SELECT COUNT(*) FROM host_samples").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def _job_pid(path: Path) -> int:
    with open_recording(path) as r:
        return r.meta["root_pid"]


def _wait_for(condition, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
