"""Processes the queue started, known by PID *and* start time so a reused PID is never mistaken
for them, and stopped as a whole: the process group, then whatever was re-parented to us."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading

from torchdoctor.sampling import procfs

_PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None when it is gone or a zombie."""
    try:
        stat = procfs.parse_pid_stat(procfs.read_path(f"/proc/{pid}/stat"))
    except (OSError, ValueError, IndexError):
        return None
    return None if stat.state in ("Z", "X") else stat.starttime


def is_alive(pid: int | None, started: int | None) -> bool:
    """Whether the process that had this PID and start time still runs."""
    return pid is not None and started is not None and start_time(pid) == started


def boot_id() -> str:
    """The kernel's id of this boot: a reboot changes it, nothing else does."""
    try:
        return procfs.read_path("/proc/sys/kernel/random/boot_id").decode().strip()
    except OSError:
        return f"btime-{procfs.boot_time():.0f}"


def become_subreaper() -> bool:
    """Have orphaned descendants re-parented to us instead of init, so none escapes a cancel."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes in process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid and start_time(int(entry)) is not None:
                    out.append(int(entry))
    return out


def own_children() -> list[int]:
    """Our live child processes (with a subreaper: orphans of the job too)."""
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = procfs.parse_pid_stat(procfs.read_path(f"/proc/{entry}/stat"))
        except (OSError, ValueError, IndexError):
            continue
        if stat.ppid == me and stat.state not in ("Z", "X"):
            out.append(int(entry))
    return out


def signal_tree(pgid: int | None, sig: int, *, children: bool = False) -> None:
    """Send ``sig`` to the process group and (``children``) to our own live children."""
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    if children:
        for pid in own_children():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def reap_children() -> None:
    """Collect every child that has ended (nothing of ours stays a zombie)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Stopper:
    """TERM now, KILL after ``grace_s`` for whatever is left: the job's group and its orphans."""

    def __init__(self, pgid: int, grace_s: float) -> None:
        self.pgid = pgid
        self.grace_s = grace_s
        self._timer: threading.Timer | None = None
        self.started = False

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        signal_tree(self.pgid, signal.SIGTERM, children=True)
        self._timer = threading.Timer(self.grace_s, self.kill)
        self._timer.daemon = True
        self._timer.start()

    def kill(self) -> None:
        signal_tree(self.pgid, signal.SIGKILL, children=True)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
