"""Processes the queue started, known by PID *and* start time so a reused PID is never mistaken
for them. Stopping a job's whole tree is :func:`torchdoctor.run.process.stop_tree`'s."""

from __future__ import annotations

import ctypes
import os

from torchdoctor.run.process import live_stat
from torchdoctor.sampling import procfs

_PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None when it is gone or a zombie."""
    stat = live_stat(pid)
    return None if stat is None else stat.starttime


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


def reap_children() -> None:
    """Collect every child that has ended (nothing of ours stays a zombie)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
