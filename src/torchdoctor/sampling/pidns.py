"""Which PID numbering /proc uses, so NVML's process PIDs can be joined to the job's.

NVML reports every GPU process by its PID in the host's (initial) PID namespace. The job's
processes are known by the PIDs this process's /proc shows. The two agree only when /proc
belongs to the host's PID namespace; inside a container with its own PID namespace the host PIDs
are not visible at all (``/proc/<pid>/status`` NSpid lists a process's PID in the namespace of
the /proc mount and in the namespaces nested below it, never above), so they cannot be mapped.
Then we say so instead of guessing.
"""

from __future__ import annotations

import os

# Inode number of the initial PID namespace (PROC_PID_INIT_INO in include/linux/proc_ns.h). It
# is a fixed constant of the kernel ABI, the same on every Linux machine.
INIT_PID_NS_INODE = 0xEFFFFFFC

UNRESOLVED_REASON = (
    "this process runs in its own PID namespace (a container?): NVML reports host PIDs, which "
    "cannot be mapped to the PIDs seen here"
)


def nspid(pid: int | str, proc: str = "/proc") -> list[int] | None:
    """The NSpid line of /proc/<pid>/status: the PID in the /proc mount's namespace first,
    then in each nested namespace. ``None`` when the process is gone or the kernel is too old
    (before 4.1) to say."""
    try:
        with open(f"{proc}/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(v) for v in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def _ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class PidNamespace:
    """Decides once whether /proc PIDs are host PIDs, and maps NVML PIDs accordingly.

    ``procfs_is_host`` overrides the detection (for a caller that knows better, and for tests
    whose fake NVML reports the PIDs they see as host PIDs).
    """

    def __init__(self, proc: str = "/proc", *, procfs_is_host: bool | None = None) -> None:
        self.proc = proc
        self.procfs_is_host = self._procfs_is_host() if procfs_is_host is None else procfs_is_host
        self.unresolved_reason: str | None = None if self.procfs_is_host else UNRESOLVED_REASON

    def _procfs_is_host(self) -> bool:
        # PID 1 of the /proc mount lives in the namespace that /proc shows. Reading its ns
        # link needs ptrace rights over PID 1, so fall back to ourselves: a process in the
        # initial namespace that /proc lists with a single NSpid entry sees host PIDs there.
        first = _ns_inode(f"{self.proc}/1/ns/pid")
        if first is not None:
            return first == INIT_PID_NS_INODE
        own = nspid("self", self.proc)
        return (
            _ns_inode(f"{self.proc}/self/ns/pid") == INIT_PID_NS_INODE
            and own is not None
            and len(own) == 1
        )

    def local_pid(self, host_pid: int) -> int | None:
        """The PID seen here for a host PID, or ``None`` when it cannot be known."""
        return host_pid if self.procfs_is_host else None
