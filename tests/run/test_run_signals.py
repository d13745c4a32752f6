"""`torchdoctor run` delivers each signal to the job exactly once, whoever sends it and to whom.

A signal sent to the whole process group (timeout(1), `kill -- -PGID`, the terminal's Ctrl-C)
reaches the job by itself; one sent to torchdoctor alone is forwarded. The job counts what it
receives, one line per signal in a file.
"""

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

from tests.conftest import TORCHDOCTOR
from torchdoctor.run.process import group_members

PY = sys.executable

# "got SIG..." on stdout per signal received, then exit 7 once no copy came for a second after
# the first (a duplicate comes microseconds or, forwarded, at most a tenth of a second later:
# no event says "no second copy is coming", so that second is the one wait here). The signals
# are blocked and taken with sigtimedwait: each delivery is seen apart, where Python's
# handlers would fold two that land before the handler runs into one call.
COUNTER = textwrap.dedent(
    """
    import signal, sys, time
    wanted = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    print("ready", flush=True)
    first = None
    while first is None or time.monotonic() - first < 1.0:
        info = signal.sigtimedwait(wanted, 0.05)
        if info is not None:
            print("got", signal.Signals(info.si_signo).name, flush=True)
            first = first or time.monotonic()
    sys.exit(7)
    """
)


def _start(tmp_path: Path, prefix: list[str] | None = None, **popen) -> subprocess.Popen:
    argv = [*(prefix or []), *TORCHDOCTOR, "run", "--quiet", "--out", str(tmp_path / "r.sqlite")]
    return subprocess.Popen(
        [*argv, "--", PY, "-c", COUNTER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_a_signal_to_torchdoctor_alone_is_forwarded_once(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert (out, err, proc.returncode) == ("got SIGTERM\n", "", 7)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_whole_group_reaches_the_job_once(tmp_path: Path, sig) -> None:
    """`kill -SIG -- -PGID`: the job gets it from the kernel; forwarding it again doubled it.

    torchdoctor is held stopped until the job has taken its copy: then a forwarded second copy
    cannot merge with the first while pending, and would be seen whatever the timing."""
    proc = _start(tmp_path, start_new_session=True)  # its own group, as a batch system makes
    assert proc.stdout.readline() == "ready\n"
    os.kill(proc.pid, signal.SIGSTOP)
    os.killpg(proc.pid, sig)
    assert proc.stdout.readline() == f"got {sig.name}\n"
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert (out, err, proc.returncode) == ("", "", 7)
    assert group_members(proc.pid) == []  # nothing of ours (the witness) is left behind


def test_a_group_signal_reaches_a_job_that_left_the_group(tmp_path: Path) -> None:
    """A job that made a process group of its own missed the group's signal: forwarded."""
    proc = subprocess.Popen(
        [*TORCHDOCTOR, "run", "--quiet", "--out", str(tmp_path / "r.sqlite"), "--",
         PY, "-c", "import os; os.setpgid(0, 0)\n" + COUNTER],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout.readline() == "ready\n"
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert (out, err, proc.returncode) == ("got SIGTERM\n", "", 7)


def test_timeout_reaches_the_job_once(tmp_path: Path) -> None:
    """timeout(1) signals its child, then its whole group. Its SIGALRM is the time running out:
    sent once the job is ready, no guess at how long starting takes."""
    proc = _start(tmp_path, prefix=["timeout", "-s", "TERM", "600"])
    assert proc.stdout.readline() == "ready\n"
    os.kill(proc.pid, signal.SIGALRM)
    out, err = proc.communicate(timeout=60)
    assert (out, err) == ("got SIGTERM\n", "")
    assert proc.returncode == 124  # timeout's own status when the time ran out


def test_ctrl_c_at_a_terminal_reaches_the_job_once(tmp_path: Path) -> None:
    master, slave = os.openpty()

    def make_controlling_tty() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [
            *TORCHDOCTOR, "run", "--quiet", "--out", str(tmp_path / "r.sqlite"), "--",
            PY, "-c", COUNTER,
        ],
        stdin=slave, stdout=slave, stderr=slave, preexec_fn=make_controlling_tty,
    )  # fmt: skip
    os.close(slave)
    seen = b""
    while b"ready" not in seen:
        chunk = os.read(master, 4096)
        assert chunk, seen
        seen += chunk
    os.write(master, b"\x03")  # Ctrl-C, as typed
    while True:  # until the job and torchdoctor have closed the terminal
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO once the last writer is gone
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 7
    assert seen.count(b"got ") == 1 and b"got SIGINT" in seen, seen
