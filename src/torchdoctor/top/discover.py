"""Finding the PyTorch jobs on the machine: processes with libtorch mapped, grouped by tree.

A process runs PyTorch when ``libtorch`` appears in its ``/proc/<pid>/maps``; that covers
scripts, notebooks, torchrun and DataLoader workers, whatever their command line says. A job
is the topmost such process of a process tree (torchrun above its ranks, a trainer above its
workers); :class:`~torchdoctor.sampling.job.JobReader` then follows everything under it.

Reading the maps of every process at every refresh would cost more than the rest of ``top``,
so each process is classified once and re-checked only when it may have changed: a Python
process that has not imported torch yet is looked at again every few seconds (often while
young), any other process only when its name changes (an ``exec``). What is known of a PID
holds while its start time does: a PID the kernel may have handed out again since the last
scan (the last PID handed out tells which) has its start time read again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from torchdoctor.sampling import procfs

MARKER = b"libtorch"
_PYTHON_MARKER = b"python"  # the interpreter binary or libpython in the maps
_CHUNK = 65536


@dataclass(slots=True)
class _Seen:
    starttime: int
    comm: str
    ppid: int
    torch: bool
    python: bool
    readable: bool
    next_check: float  # monotonic time of the next look at a non-torch process


@dataclass(slots=True)
class Discovery:
    """PyTorch processes found at one scan."""

    roots: list[int]  # topmost PyTorch process of each tree, sorted
    torch_pids: set[int]
    ppid: dict[int, int]  # parent of every process seen (for walking up to a registered one)
    unreadable: int  # processes whose maps could not be read (other users' without privilege)


def maps_mention(pid: int, marker: bytes = MARKER, proc: str = "/proc") -> tuple[bool, bool]:
    """(``marker`` is mapped, python is mapped) for ``pid``; raises OSError when unreadable.

    Reads in chunks and stops at the marker: a trainer's maps run to hundreds of KiB and
    libtorch sits early in them (libraries loaded late get low addresses).
    """
    fd = procfs.open_ro(f"{proc}/{pid}/maps")
    try:
        python = False
        tail = b""
        offset = 0
        while True:
            chunk = os.pread(fd, _CHUNK, offset)
            if not chunk:
                return False, python
            offset += len(chunk)
            window = tail + chunk
            if marker in window:
                return True, True
            python = python or _PYTHON_MARKER in window
            tail = window[-len(marker) :]
    finally:
        os.close(fd)


class TorchProcessFinder:
    """Scans /proc for PyTorch processes; cheap on a steady machine.

    ``young_s``: a Python process younger than this is re-checked every ``young_every_s``
    (it may be importing torch right now); older ones every ``old_every_s``. Processes that
    are not Python are re-checked every ``other_every_s`` by their name only.
    """

    def __init__(
        self,
        *,
        young_s: float = 120.0,
        young_every_s: float = 2.0,
        old_every_s: float = 15.0,
        other_every_s: float = 10.0,
        proc: str = "/proc",
    ) -> None:
        self.young_s = young_s
        self.young_every_s = young_every_s
        self.old_every_s = old_every_s
        self.other_every_s = other_every_s
        self._proc = proc
        self._seen: dict[int, _Seen] = {}
        self._last_pid: int | None = None  # the last PID handed out, as of the previous scan
        self._self_pid = os.getpid()
        self._btime = procfs.boot_time()

    def scan(self, table: procfs.ProcTable | None = None) -> Discovery:
        """``table``: the refresh's look at /proc, shared with the job readers."""
        now = time.monotonic()
        if table is None:
            table = procfs.ProcTable(self._proc)
        listing = table.pids
        seen = self._seen
        for pid in seen.keys() - listing:
            del seen[pid]
        # A process is known by its PID until that PID may have been handed out again: then
        # its start time says whether it is still the process classified (a PyTorch process
        # that ended and whose PID went to another program within one refresh is not a job).
        last = table.last_pid
        if last is None or self._last_pid is None:
            recheck = set(seen)  # no last PID to go by: any PID may have been reused
        elif last != self._last_pid:
            recheck = set(procfs.handed_out(seen, self._last_pid, last))
        else:
            recheck = set()
        self._last_pid = last
        uptime_now = time.time() - self._btime
        for pid in listing:
            entry = seen.get(pid)
            known = entry is not None and (entry.torch or now < entry.next_check)
            if known and pid not in recheck:
                continue
            st = table.stat(pid)
            if st is not None and st.state in ("Z", "X", "x"):
                st = None
            if st is None:
                seen.pop(pid, None)
                continue
            if entry is not None and entry.starttime == st.starttime:
                entry.ppid = st.ppid
                if entry.torch or now < entry.next_check:
                    continue  # the same process, looked at again only for its PID's sake
                if not entry.python and entry.comm == st.comm:
                    entry.next_check = now + self.other_every_s
                    continue
            entry = self._classify(pid, st, now, uptime_now)
            seen[pid] = entry

        torch_pids = {pid for pid, e in seen.items() if e.torch and pid != self._self_pid}
        ppid = {pid: e.ppid for pid, e in seen.items()}
        roots = sorted(pid for pid in torch_pids if not _has_torch_ancestor(pid, ppid, torch_pids))
        unreadable = sum(1 for e in seen.values() if not e.readable)
        return Discovery(roots=roots, torch_pids=torch_pids, ppid=ppid, unreadable=unreadable)

    def _classify(self, pid: int, st: procfs.PidStat, now: float, uptime: float) -> _Seen:
        readable = True
        try:
            torch, python = maps_mention(pid, proc=self._proc)
        except OSError:
            # Kernel threads have empty maps; other users' processes refuse us (EACCES).
            torch = python = False
            readable = st.rss_pages == 0  # a kernel thread is no loss
        age = uptime - st.starttime / procfs.CLK_TCK
        if python:
            every = self.young_every_s if age < self.young_s else self.old_every_s
        else:
            every = self.other_every_s
        return _Seen(
            starttime=st.starttime,
            comm=st.comm,
            ppid=st.ppid,
            torch=torch,
            python=python,
            readable=readable,
            next_check=now + every,
        )


def _has_torch_ancestor(pid: int, ppid: dict[int, int], torch_pids: set[int]) -> bool:
    parent = ppid.get(pid)
    hops = 0
    while parent and parent in ppid and hops < 64:
        if parent in torch_pids:
            return True
        parent = ppid.get(parent)
        hops += 1
    return False
