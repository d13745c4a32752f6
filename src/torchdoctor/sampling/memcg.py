"""The job's memory cgroup and the kernel's OOM killer: what the recorder keeps of them.

The OOM killer ends a process with SIGKILL, which nothing inside the process sees. What is left
to tell it happened: the ``oom_kill`` counter of the memory cgroup whose limit was hit (cgroup
v2 ``memory.events``, v1 ``memory.oom_control``), and the kernel log line naming the victim
(``/dev/kmsg``, readable as root on most machines). :class:`MemoryWatch` takes the counters when
it first sees each cgroup of the job and again at the job's end; the difference is the kills
that happened while the job ran. The kernel log is read without blocking and only from the
moment the watch started, so earlier kills of other programs are not blamed on the job.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

from torchdoctor.sampling import procfs

KMSG = "/dev/kmsg"
NEAR_LIMIT = 0.5  # share of the limit from which each process's PSS is read at every sample
MAX_KERNEL_LINES = 40  # an OOM report is ~30 lines per kill; keep the ones that say who and why
_KMSG_KEEP = re.compile(
    rb"oom|Killed process|Memory cgroup out of memory|out of memory", re.IGNORECASE
)
# "Killed process 1234 (python3) total-vm:123kB, anon-rss:45kB, file-rss:6kB, shmem-rss:0kB, ..."
_VICTIM = re.compile(
    r"Killed process (\d+) \(([^)]*)\)(?:.*?total-vm:(\d+)kB)?(?:.*?anon-rss:(\d+)kB)?"
    r"(?:.*?file-rss:(\d+)kB)?(?:.*?shmem-rss:(\d+)kB)?"
)


@dataclass(slots=True)
class CgroupMemory:
    """One reading of the memory cgroup a process is in (and the limits above it)."""

    version: int  # 1 or 2
    path: str  # the process's own memory cgroup directory
    limit: int | None  # bytes, the tightest along the hierarchy; None: no limit
    limit_path: str | None  # the directory that sets ``limit``
    current: int | None  # bytes charged now (v2 memory.current, v1 memory.usage_in_bytes)
    peak: int | None  # the high-water mark (v2 memory.peak, v1 memory.max_usage_in_bytes)
    swap_limit: int | None = None  # v2 memory.swap.max; None: no limit or not readable


@dataclass(slots=True)
class OomVictim:
    """A process the kernel's OOM killer ended, as its log line names it."""

    pid: int
    name: str
    total_vm: int | None  # bytes
    anon_rss: int | None
    file_rss: int | None
    shmem_rss: int | None


@dataclass(slots=True)
class MemoryEnd:
    """How the job's memory stood when it ended; stored as the recording's ``memory_end``."""

    oom_kills: int | None  # kills in the job's cgroups while it ran; None: counters unreadable
    cgroup: CgroupMemory | None  # the last reading taken while the job ran
    victims: list[OomVictim] = field(default_factory=list)
    kernel_log: list[str] = field(default_factory=list)
    kernel_log_unavailable: str | None = None  # why the kernel log could not be read
    unavailable: str | None = None  # why the cgroup could not be read

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def oom_kill_count(version: int, directory: str) -> int | None:
    """The cgroup's ``oom_kill`` counter (v2 memory.events, v1 memory.oom_control)."""
    name = "memory.events" if version == 2 else "memory.oom_control"
    try:
        data = b"\n" + procfs.read_path(os.path.join(directory, name))
    except OSError:
        return None
    return procfs._find_int(data, b"\noom_kill ")


def _read_int(path: str) -> int | None:
    text = procfs.read_text(path)
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < procfs._NO_LIMIT else None


_TASK_MEMCG = re.compile(r"task_memcg=([^,\s]+)")


def read_cgroup_memory(paths: procfs.CgroupPaths) -> CgroupMemory | None:
    """The memory state of the cgroup ``paths`` names; None without a memory controller."""
    version = paths.memory_version
    if version is None or not paths.memory_dirs:
        return None
    own = paths.memory_dirs[0]
    limit_name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    limit = limit_path = None
    for d in paths.memory_dirs:
        value = _read_int(os.path.join(d, limit_name))
        if value is not None and (limit is None or value < limit):
            limit, limit_path = value, d
    if version == 2:
        current = _read_int(os.path.join(own, "memory.current"))
        peak = _read_int(os.path.join(own, "memory.peak"))
        swap = _read_int(os.path.join(own, "memory.swap.max"))
    else:
        current = _read_int(os.path.join(own, "memory.usage_in_bytes"))
        peak = _read_int(os.path.join(own, "memory.max_usage_in_bytes"))
        swap = None
    return CgroupMemory(version, own, limit, limit_path, current, peak, swap)


def parse_victims(lines: list[str]) -> list[OomVictim]:
    """The processes named by "Killed process PID (NAME) ..." lines, in order."""
    out = []
    for line in lines:
        m = _VICTIM.search(line)
        if m is None:
            continue
        kb = [int(v) * 1024 if v is not None else None for v in m.groups()[2:]]
        out.append(OomVictim(int(m.group(1)), m.group(2), *kb))
    return out


class KernelLog:
    """The kernel log from now on, read without blocking; ``error`` says why it cannot be."""

    def __init__(self, path: str = KMSG) -> None:
        self.fd: int | None = None
        self.error: str | None = None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self.fd, 0, os.SEEK_END)  # only what is logged after the job started
        except OSError as exc:
            self.error = f"{path}: {exc.strerror or exc}"
            self.close()

    def read_oom_lines(self) -> list[str]:
        """The OOM killer's lines logged since the last call (at most MAX_KERNEL_LINES)."""
        if self.fd is None:
            return []
        kept: list[str] = []
        while True:
            try:
                record = os.read(self.fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them
                    continue
                self.error = f"{KMSG}: {exc.strerror or exc}"
                break
            if not record:
                break
            # "PRIO,SEQ,USEC,FLAGS;message\n" followed by " KEY=VALUE" continuation lines.
            _, _, message = record.partition(b";")
            message = message.split(b"\n", 1)[0]
            if _KMSG_KEEP.search(message) and len(kept) < MAX_KERNEL_LINES:
                kept.append(message.decode("utf-8", "replace"))
        return kept

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class MemoryWatch:
    """Follows the memory cgroup of the job's root process until the job ends.

    :meth:`refresh` (called with every sample) notices when the job moves to another cgroup
    (a job that places itself in a limited one) and takes that cgroup's ``oom_kill`` counter
    then; :meth:`finish` compares every counter seen with its value at the end.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.kernel = KernelLog()
        self.last: CgroupMemory | None = None
        self.unavailable: str | None = None
        self._proc_cgroup: bytes | None = None
        self._paths: procfs.CgroupPaths | None = None
        self._baseline: dict[tuple[int, str], int | None] = {}
        self.refresh()

    def refresh(self) -> None:
        try:
            state = procfs.parse_pid_stat(procfs.read_path(f"/proc/{self.pid}/stat")).state
            # An exited process (a zombie until reaped) is moved to the root cgroup: keep
            # the cgroup it ran in.
            if state in ("Z", "X"):
                return
            text = procfs.read_path(f"/proc/{self.pid}/cgroup")
        except (OSError, ValueError, IndexError):
            return  # the job has ended: keep its last cgroup
        if text != self._proc_cgroup:
            self._proc_cgroup = text
            paths = procfs.cgroup_paths(self.pid)
            if paths.memory_version is None or not paths.memory_dirs:
                self.unavailable = "no memory cgroup controller found for the job"
                return
            self.unavailable = None
            for d in paths.memory_dirs:
                key = (paths.memory_version, d)
                if key not in self._baseline:
                    self._baseline[key] = oom_kill_count(paths.memory_version, d)
            self._paths = paths
        if self._paths is not None and self.unavailable is None:
            self.last = read_cgroup_memory(self._paths) or self.last

    @property
    def near_limit(self) -> bool:
        """The job holds over NEAR_LIMIT of its cgroup's limit: an OOM kill may come soon."""
        last = self.last
        return bool(last and last.limit and last.current and last.current > NEAR_LIMIT * last.limit)

    def _cgroup_named_by(self, lines: list[str]) -> procfs.CgroupPaths | None:
        """The memory cgroup an ``oom-kill:... task_memcg=/PATH`` line names, on the mount the
        job's first cgroup lives on; None when no line names one or it is gone."""
        if self._paths is None or not self._paths.memory_dirs:
            return None
        mount = self._paths.memory_dirs[-1]
        for line in reversed(lines):
            m = _TASK_MEMCG.search(line)
            if m is None:
                continue
            own = os.path.normpath(mount + "/" + m.group(1).strip("/"))
            if not own.startswith(mount) or not os.path.isdir(own):
                return None
            dirs = [own]
            while dirs[-1] != mount:
                dirs.append(os.path.dirname(dirs[-1]))
            named = procfs.CgroupPaths()
            named.version = self._paths.version
            named.memory_version = self._paths.memory_version
            named.memory_dirs = dirs
            return named
        return None

    def finish(self) -> MemoryEnd:
        """The kills counted while the job ran, its last cgroup reading and the kernel's words."""
        kills: int | None = None
        for (version, d), before in self._baseline.items():
            after = oom_kill_count(version, d)
            if before is not None and after is not None:
                kills = (kills or 0) + max(0, after - before)
        lines = self.kernel.read_oom_lines()
        if self.last is None or self.last.limit is None:
            # A job that joined a limited cgroup and was killed there between two samples was
            # never read in it: the kernel's line names that cgroup, which outlives the job.
            named = self._cgroup_named_by(lines)
            if named is not None:
                self.last = read_cgroup_memory(named) or self.last
                if not kills:  # its counter was never read before: the kernel's lines count
                    kills = len(parse_victims(lines)) or kills
        end = MemoryEnd(
            oom_kills=kills,
            cgroup=self.last,
            victims=parse_victims(lines),
            kernel_log=lines,
            kernel_log_unavailable=self.kernel.error,
            unavailable=self.unavailable,
        )
        self.kernel.close()
        return end


def ended_by(status: int | None) -> str | None:
    """The signal's name when a shell status (128+N) says signal N ended the command."""
    if status is None or status <= 128:
        return None
    try:
        return signal.Signals(status - 128).name
    except ValueError:
        return None


__all__ = [
    "CgroupMemory",
    "KernelLog",
    "MemoryEnd",
    "MemoryWatch",
    "OomVictim",
    "ended_by",
    "oom_kill_count",
    "parse_victims",
    "read_cgroup_memory",
]
