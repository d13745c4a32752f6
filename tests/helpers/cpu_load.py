"""How much CPU other programs took while a test ran: the measure a verdict about contention is
judged against, on a machine the test does not have to itself.

It reads /proc: the CPU time (utime + stime) of every process outside the job's tree, between
two reads, over the wall time between them. A process that starts or ends in between counts
for the part seen by both reads (a busy loop beside the test is there throughout).
"""

from __future__ import annotations

import os
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, starttime, utime + stime) of every process readable now."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        # fields[0] is the state (field 3): ppid is field 4, utime 14, stime 15, starttime 22
        out[int(name)] = (int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12]))
    return out


def _tree(processes: dict[int, tuple[int, int, int]], root: int) -> set[int]:
    members = {root}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _, _) in processes.items():
            if ppid in members and pid not in members:
                members.add(pid)
                grew = True
    return members


class OtherLoad:
    """CPUs' worth of work done by processes outside ``root``'s tree (and outside us) since
    this object was made: ``cpus()`` at any time after."""

    def __init__(self, root: int) -> None:
        self.root = root
        self._t0 = time.monotonic()
        self._before = _processes()

    def cpus(self) -> float:
        now = _processes()
        elapsed = time.monotonic() - self._t0
        ours = _tree(now, self.root) | _tree(self._before, self.root) | {os.getpid()}
        used = 0
        for pid, (_, start, ticks) in now.items():
            seen = self._before.get(pid)
            if pid in ours or seen is None or seen[1] != start:
                continue
            used += ticks - seen[2]
        return used / CLK_TCK / max(elapsed, 1e-6)


def _busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (every field of /proc/stat's cpu
    line but idle and iowait; guest time is already inside user and nice)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


def _own_s() -> float:
    """CPU seconds this process and its waited-for descendants used."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class MachineLoad:
    """CPUs' worth of work done by everything but this process and the children it ran to
    completion, since this object was made: ``cpus()`` after those children were waited for.

    Unlike :class:`OtherLoad` it counts processes that start and end between the two reads (a
    test run beside this one starts a process for each command), since it reads the machine's
    total from /proc/stat and subtracts what the test itself used."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._busy = _busy_s()
        self._own = _own_s()

    def cpus(self) -> float:
        elapsed = time.monotonic() - self._t0
        others = (_busy_s() - self._busy) - (_own_s() - self._own)
        return max(others, 0.0) / max(elapsed, 1e-6)


class LoadBesides(MachineLoad):
    """:class:`MachineLoad` less the CPU of ``root``'s process tree, which still runs: what
    the rest of the machine (short-lived processes included) took beside the job since this
    object was made. A tree member that ended between two reads is counted as the machine's,
    which errs towards "the machine was busy" (the lenient side for a contention verdict)."""

    def __init__(self, root: int) -> None:
        super().__init__()
        self.root = root
        self._before = _processes()

    def cpus(self) -> float:
        now = _processes()
        elapsed = time.monotonic() - self._t0
        tree = 0
        for pid in _tree(now, self.root):
            if pid not in now:
                continue
            _, start, ticks = now[pid]
            seen = self._before.get(pid)
            tree += ticks - (seen[2] if seen is not None and seen[1] == start else 0)
        return max(super().cpus() - tree / CLK_TCK / max(elapsed, 1e-6), 0.0)
