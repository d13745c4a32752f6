"""Small, fast parsers of Linux /proc and cgroup files.

Files are read through file descriptors kept open between samples and re-read with
``pread(fd, n, 0)``: the kernel regenerates a /proc file when it is read from offset 0, and
skipping open/close halves the cost of a read. A descriptor of ``/proc/<pid>/...`` stays bound
to the process it was opened for: once that process is gone, reads fail with ESRCH even if the
PID has been reused, so a reused PID can never feed another process's counters.

Parsers take ``bytes`` and return plain values; they never raise on a missing key (``None``
instead). Readers raise ``OSError`` (``FileNotFoundError``, ``ProcessLookupError``,
``PermissionError``) and the callers decide what a failure means.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CLK_TCK = os.sysconf("SC_CLK_TCK")
SECTOR_SIZE = 512  # /proc/diskstats counts 512-byte sectors whatever the device's block size

# Errors that mean "this process (or file) is not there / not for us": a process that exits
# while being read raises any of them depending on where the kernel notices.
GONE = (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError)


# --- reading ---------------------------------------------------------------------------------


def open_ro(path: str | bytes) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def pread_single(fd: int, size: int = 4096) -> bytes:
    """Read a single-record /proc file (stat, status, io, meminfo, smaps_rollup...).

    Such files are generated whole on every read from offset 0, so a read shorter than the
    buffer is the complete file; a full buffer means it may be longer and is read again bigger.
    """
    while True:
        data = os.pread(fd, size, 0)
        if len(data) < size:
            return data
        size *= 4


def pread_all(fd: int, size: int = 8192) -> bytes:
    """Read a multi-record /proc file (vmstat, diskstats): the kernel hands it out in chunks,
    so a short read is not the end; read on until an empty one."""
    chunks = []
    offset = 0
    while True:
        data = os.pread(fd, size, offset)
        if not data:
            return b"".join(chunks)
        chunks.append(data)
        offset += len(data)


def read_path(path: str | bytes, size: int = 4096) -> bytes:
    """Open, read whole and close: for files read once (cmdline, environ, cgroup limits)."""
    fd = open_ro(path)
    try:
        return pread_all(fd, size)
    finally:
        os.close(fd)


def read_text(path: str | bytes) -> str | None:
    """The whole file as stripped text, or ``None`` when it cannot be read."""
    try:
        return read_path(path).decode("utf-8", "replace").strip()
    except OSError:
        return None


def _find_int(data: bytes, key: bytes, start: int = 0) -> int | None:
    """Integer after ``key`` (which must include its separator, e.g. b"\\nVmSwap:")."""
    i = data.find(key, start)
    if i < 0:
        return None
    j = i + len(key)
    end = data.find(b"\n", j)
    field = data[j:end] if end >= 0 else data[j:]
    parts = field.split()
    if not parts:
        return None
    try:
        return int(parts[0])
    except ValueError:
        return None


# --- host files ------------------------------------------------------------------------------

CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


class ProcStat:
    """Parsed /proc/stat: cumulative CPU ticks per CPU and system-wide counters."""

    __slots__ = ("total", "per_cpu", "ctxt", "procs_running", "procs_blocked", "btime")

    def __init__(self) -> None:
        self.total: tuple[int, ...] | None = None
        self.per_cpu: dict[int, tuple[int, ...]] = {}
        self.ctxt: int | None = None
        self.procs_running: int | None = None
        self.procs_blocked: int | None = None
        self.btime: int | None = None


def parse_proc_stat(data: bytes) -> ProcStat:
    out = ProcStat()
    per_cpu = out.per_cpu
    for line in data.split(b"\n"):
        if line.startswith(b"cpu"):
            parts = line.split()
            # user nice system idle iowait irq softirq steal (guest is already inside user)
            ticks = tuple(map(int, parts[1:9]))
            if len(ticks) < 8:
                ticks = ticks + (0,) * (8 - len(ticks))
            name = parts[0]
            if name == b"cpu":
                out.total = ticks
            else:
                per_cpu[int(name[3:])] = ticks
        elif line.startswith(b"ctxt "):
            out.ctxt = int(line[5:])
        elif line.startswith(b"procs_running "):
            out.procs_running = int(line[14:])
        elif line.startswith(b"procs_blocked "):
            out.procs_blocked = int(line[14:])
        elif line.startswith(b"btime "):
            out.btime = int(line[6:])
    return out


def boot_time() -> float:
    """Boot time as UNIX seconds (``btime`` of /proc/stat), the base of process start times."""
    stat = parse_proc_stat(read_path("/proc/stat", 65536))
    if stat.btime is None:
        raise OSError("no btime in /proc/stat")
    return float(stat.btime)


_boot_time: float | None = None


def started_at(starttime: int) -> float:
    """A process's start in UNIX seconds (psutil's ``create_time``) from its stat's
    ``starttime`` (clock ticks since boot), on the boot time read once: a check of many PIDs at
    every scrape would otherwise read /proc/stat as often."""
    global _boot_time
    if _boot_time is None:
        _boot_time = boot_time()
    return _boot_time + starttime / CLK_TCK


def create_time(pid: int) -> float:
    """When process ``pid`` started, in UNIX seconds: one read of its stat file. Raises
    ``OSError`` when the process is not there."""
    return started_at(parse_pid_stat(read_path(f"/proc/{pid}/stat")).starttime)


# The kernel marks its own threads (kthreadd, kworkers) with PF_KTHREAD in the flags field of
# /proc/PID/stat (include/linux/sched.h); they have no user memory, no command line, no Python.
PF_KTHREAD = 0x00200000


def is_kernel_thread(pid: int) -> bool:
    """Whether ``pid`` is a kernel thread. Raises ``OSError`` when the process is not there."""
    return stat_is_kernel_thread(read_path(f"/proc/{pid}/stat"))


def stat_is_kernel_thread(data: bytes) -> bool:
    """Whether a /proc/PID/stat line is a kernel thread's: PF_KTHREAD in its flags (field 9)."""
    fields = data[data.rindex(b")") + 2 :].split()  # after "(comm) ": state is field 3
    return bool(int(fields[6]) & PF_KTHREAD)


def parse_meminfo_fields(data: bytes) -> tuple[int | None, int | None, int | None, int | None]:
    """(MemTotal, MemAvailable, SwapTotal, SwapFree) in bytes; the hot-path subset."""
    values = []
    for key in (b"MemTotal:", b"\nMemAvailable:", b"\nSwapTotal:", b"\nSwapFree:"):
        v = _find_int(data, key)
        values.append(v * 1024 if v is not None else None)
    return values[0], values[1], values[2], values[3]


def parse_vmstat_fields(data: bytes, keys: tuple[bytes, ...]) -> list[int | None]:
    """Values of the named /proc/vmstat counters (``None`` for a counter this kernel lacks)."""
    prefixed = b"\n" + data
    return [_find_int(prefixed, b"\n" + k + b" ") for k in keys]


def parse_loadavg(data: bytes) -> tuple[float, float, float]:
    parts = data.split()
    return float(parts[0]), float(parts[1]), float(parts[2])


def parse_diskstats(data: bytes, include: set[str]) -> tuple[int, int, set[str]]:
    """(sectors read, sectors written) summed over the devices in ``include``, and the set
    of all device names seen (so the caller can classify devices it has not met yet)."""
    read = written = 0
    names = set()
    for line in data.split(b"\n"):
        parts = line.split()
        if len(parts) < 10:
            continue
        name = parts[2].decode()
        names.add(name)
        if name in include:
            read += int(parts[5])
            written += int(parts[9])
    return read, written, names


def is_whole_physical_disk(name: str, sys_block: str = "/sys/block") -> bool:
    """Whether a diskstats device counts towards disk I/O without double counting.

    Partitions are not in /sys/block (their I/O is already in their disk's); loop, ram and
    zram devices are memory or files on other disks; stacked devices (device-mapper, md
    RAID, bcache) have ``slaves`` and their I/O reaches the disks below them anyway.
    """
    if name.startswith(("loop", "ram", "zram", "fd", "sr", "nbd")):
        return False
    base = os.path.join(sys_block, name.replace("/", "!"))
    if not os.path.exists(base):
        return False
    try:
        if os.listdir(os.path.join(base, "slaves")):
            return False
    except OSError:
        pass
    return True


def parse_pressure(data: bytes) -> tuple[float | None, float | None]:
    """avg10 of the ``some`` and ``full`` lines of a /proc/pressure file (percent)."""
    some = full = None
    for line in data.split(b"\n"):
        if line.startswith(b"some "):
            some = _avg10(line)
        elif line.startswith(b"full "):
            full = _avg10(line)
    return some, full


def parse_pressure_totals(data: bytes) -> tuple[float | None, float | None]:
    """Cumulative stall seconds (``total=``, microseconds in the file) of ``some`` and ``full``."""
    some = full = None
    for line in data.split(b"\n"):
        i = line.find(b"total=")
        if i < 0:
            continue
        value = int(line[i + 6 :].split(None, 1)[0]) / 1e6
        if line.startswith(b"some "):
            some = value
        elif line.startswith(b"full "):
            full = value
    return some, full


def _avg10(line: bytes) -> float | None:
    i = line.find(b"avg10=")
    if i < 0:
        return None
    end = line.find(b" ", i)
    return float(line[i + 6 : end if end >= 0 else None])


# --- process files ---------------------------------------------------------------------------


class PidStat:
    """The fields of /proc/<pid>/stat torchdoctor uses."""

    __slots__ = ("comm", "state", "ppid", "utime", "stime", "threads", "starttime", "rss_pages")

    def __init__(self, comm, state, ppid, utime, stime, threads, starttime, rss_pages) -> None:
        self.comm: str = comm
        self.state: str = state
        self.ppid: int = ppid
        self.utime: int = utime  # clock ticks, whole thread group
        self.stime: int = stime
        self.threads: int = threads
        self.starttime: int = starttime  # clock ticks after boot: with the PID, the identity
        self.rss_pages: int = rss_pages


def parse_pid_stat(data: bytes) -> PidStat:
    # comm is in parentheses and may itself contain spaces and ')', so split at the last ')'.
    lpar = data.find(b"(")
    rpar = data.rfind(b")")
    f = data[rpar + 2 :].split()
    # f[0] is field 3 (state); field N of proc(5) is f[N - 3]
    return PidStat(
        data[lpar + 1 : rpar].decode("utf-8", "replace"),
        chr(f[0][0]),
        int(f[1]),
        int(f[11]),
        int(f[12]),
        int(f[17]),
        int(f[19]),
        int(f[21]),
    )


def handed_out(pids: Iterable[int], prev_last: int, last: int) -> list[int]:
    """Those of ``pids`` the kernel may have handed out again since its last PID was
    ``prev_last`` (it is ``last`` now): PIDs are handed out in turn, wrapping at pid_max, so a
    PID outside that range still names the process it named then."""
    if prev_last <= last:
        return [p for p in pids if prev_last < p <= last]
    return [p for p in pids if p > prev_last or p <= last]  # wrapped around pid_max


class ProcTable:
    """One look at /proc shared by every reader of one refresh: the last PID handed out, the
    PIDs listed and the stat of each PID asked about, each read at most once, when first
    asked. ``top`` follows every job on the machine with a JobReader each; without it each
    reader listed /proc and read the stat of every new PID itself (a hundred jobs, a hundred
    times). Take a new one per refresh: what it read is as of its first read. ``loadavg_fd``:
    a descriptor of /proc/loadavg the caller keeps open, read instead of opening the file."""

    __slots__ = ("_proc", "_loadavg_fd", "_last_read", "_last_pid", "_pids", "_stats")

    def __init__(self, proc: str = "/proc", loadavg_fd: int | None = None) -> None:
        self._proc = proc
        self._loadavg_fd = loadavg_fd
        self._last_read = False
        self._last_pid: int | None = None
        self._pids: frozenset[int] | None = None
        self._stats: dict[int, PidStat | None] = {}

    @property
    def last_pid(self) -> int | None:
        """The last PID the kernel handed out (5th field of loadavg); None if unreadable."""
        if not self._last_read:
            self._last_read = True
            try:
                fd = self._loadavg_fd
                data = (
                    pread_single(fd, 256)
                    if fd is not None
                    else read_path(f"{self._proc}/loadavg", 256)
                )
                self._last_pid = int(data.split()[4])
            except (OSError, ValueError, IndexError):
                self._last_pid = None
        return self._last_pid

    @property
    def pids(self) -> frozenset[int]:
        """Every PID in /proc (empty when it cannot be listed)."""
        if self._pids is None:
            # The last PID first: a PID handed out after it is listed or newer than it, and a
            # reader that keeps the last PID lists /proc again once it changes.
            _ = self.last_pid
            try:
                self._pids = frozenset(int(n) for n in os.listdir(self._proc) if n.isdigit())
            except OSError:
                self._pids = frozenset()
        return self._pids

    def stat(self, pid: int) -> PidStat | None:
        """``pid``'s stat, None when it is gone or cannot be read."""
        try:
            return self._stats[pid]
        except KeyError:
            pass
        try:
            st: PidStat | None = parse_pid_stat(read_path(f"{self._proc}/{pid}/stat", 1024))
        except (OSError, ValueError, IndexError):
            st = None
        self._stats[pid] = st
        return st


def parse_pid_status(data: bytes) -> tuple[int | None, int | None, int | None]:
    """(VmSwap bytes, voluntary, involuntary context switches) from /proc/<pid>/status.

    The context switch counts are the main thread's: the kernel does not sum them over the
    threads here (psutil's num_ctx_switches reports the same numbers).
    """
    # Hot path: find each key and convert the number up to the end of its line.
    swap = vol = invol = None
    i = data.find(b"\nVmSwap:")
    if i >= 0:
        swap = int(data[i + 8 : data.find(b"kB", i)]) * 1024
    i = data.find(b"\nvoluntary_ctxt_switches:")
    if i >= 0:
        j = data.find(b"\n", i + 25)
        vol = int(data[i + 25 : j if j >= 0 else None])
    i = data.find(b"\nnonvoluntary_ctxt_switches:")
    if i >= 0:
        j = data.find(b"\n", i + 28)
        invol = int(data[i + 28 : j if j >= 0 else None])
    return swap, vol, invol


def parse_rss_shmem(data: bytes) -> int | None:
    """RssShmem bytes from /proc/<pid>/status (Linux >= 4.5): the shared memory pages the
    process maps (tmpfs files such as /dev/shm, SysV segments, shared anonymous memory)."""
    kb = _find_int(data, b"\nRssShmem:")
    return None if kb is None else kb * 1024


def parse_schedstat(data: bytes) -> float:
    """Seconds the task waited on a run queue, runnable but not running, since it started:
    the second of /proc/<pid>/schedstat's three figures (nanoseconds; the task is the
    process's main thread). Raises ValueError when the text is not three integers."""
    fields = data.split()
    if len(fields) != 3:
        raise ValueError(f"schedstat {data[:40]!r}")
    return int(fields[1]) / 1e9


DEV_SHM = "/dev/shm/"
_DEV_SHM_B = b" /dev/shm/"


def dev_shm_files(pid: int) -> dict[tuple[int, int], int]:
    """The /dev/shm files process ``pid`` holds: ``(st_dev, inode) -> bytes``.

    Held means open (``/proc/<pid>/fd``) or mapped (``/proc/<pid>/maps``): torch's DataLoader
    workers pass batches in /dev/shm files they unlink at once (``torch_<n>`` ... "(deleted)"),
    so the space is found through the descriptors and mappings that keep it, not by listing
    /dev/shm. An open file counts its allocated blocks (tmpfs allocates what is written); a
    file only mapped counts the mapped extent. OSError (ProcessLookupError when it is gone,
    PermissionError for another user's process) is the caller's to handle.
    """
    files: dict[tuple[int, int], int] = {}
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        link = f"{fd_dir}/{name}"
        try:
            if not os.readlink(link).startswith(DEV_SHM):
                continue
            st = os.stat(link)  # the open file itself, even once unlinked
        except OSError:
            continue  # closed meanwhile
        files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    with open(f"/proc/{pid}/maps", "rb") as f:
        data = f.read()
    if _DEV_SHM_B not in data:
        return files
    extents: dict[tuple[int, int], int] = {}
    for line in data.splitlines():
        if _DEV_SHM_B not in line:
            continue
        # start-end perms offset major:minor inode path
        parts = line.split(None, 5)
        try:
            start, end = (int(x, 16) for x in parts[0].split(b"-"))
            major, minor = (int(x, 16) for x in parts[3].split(b":"))
            key = (os.makedev(major, minor), int(parts[4]))
            offset = int(parts[2], 16)
        except (ValueError, IndexError):
            continue
        if key not in files:
            extents[key] = max(extents.get(key, 0), offset + end - start)
    files.update(extents)
    return files


def parse_pid_io(data: bytes) -> tuple[int | None, int | None]:
    """(read_bytes, write_bytes) from /proc/<pid>/io: bytes that reached the storage layer."""
    rd = wr = None
    i = data.find(b"\nread_bytes:")
    if i >= 0:
        rd = int(data[i + 12 : data.find(b"\n", i + 12)])
    i = data.find(b"\nwrite_bytes:")
    if i >= 0:
        wr = int(data[i + 13 : data.find(b"\n", i + 13)])
    return rd, wr


def parse_smaps_rollup(data: bytes) -> tuple[int | None, int | None]:
    """(PSS, USS) in bytes. USS = private clean + private dirty, as psutil defines it."""
    pss = _find_int(data, b"\nPss:")
    clean = _find_int(data, b"\nPrivate_Clean:")
    dirty = _find_int(data, b"\nPrivate_Dirty:")
    uss = (clean + dirty) * 1024 if clean is not None and dirty is not None else None
    return (pss * 1024 if pss is not None else None), uss


def parse_cmdline(data: bytes) -> list[str]:
    if not data:
        return []
    if data.endswith(b"\0"):
        data = data[:-1]
    return [a.decode("utf-8", "replace") for a in data.split(b"\0")]


def parse_environ(data: bytes, names: tuple[str, ...] | None) -> dict[str, str]:
    """The named variables (all when ``names`` is None) of a /proc/<pid>/environ block
    (the environment at exec time)."""
    out: dict[str, str] = {}
    wanted = None if names is None else {n.encode() + b"=": n for n in names}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            name = key.decode("utf-8", "replace") if wanted is None else wanted.get(key + b"=")
            if name is not None:
                out[name] = value.decode("utf-8", "replace")
    return out


# --- cgroups ---------------------------------------------------------------------------------

# v1 stores "no memory limit" as the largest page-aligned counter; anything this big is no limit.
_NO_LIMIT = 1 << 60


class CgroupPaths:
    """Where the cpu and memory controllers of one process's cgroup live on this machine.

    ``cpu_dirs`` / ``memory_dirs`` run from the process's own cgroup up to the root of the
    mount: a limit set on any ancestor applies too.
    """

    __slots__ = ("version", "cpu_version", "cpu_dirs", "memory_version", "memory_dirs")

    def __init__(self) -> None:
        self.version: int | None = None
        self.cpu_version: int | None = None
        self.cpu_dirs: list[str] = []
        self.memory_version: int | None = None
        self.memory_dirs: list[str] = []


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root, mount point, super options) of cgroup mounts, from mountinfo."""
    out = []
    try:
        text = read_path("/proc/self/mountinfo", 65536).decode("utf-8", "replace")
    except OSError:
        return out
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        rparts = right.split()
        if len(rparts) < 3 or rparts[0] not in ("cgroup", "cgroup2"):
            continue
        lparts = left.split()
        out.append((rparts[0], lparts[3], lparts[4], set(rparts[2].split(","))))
    return out


def _chain(mount_point: str, mount_root: str, cg_path: str) -> list[str]:
    """Directories from the cgroup up to the mount point, existing ones only.

    Inside a cgroup namespace the path may not resolve under the mount; then the mount
    point itself (the namespace's root, i.e. our cgroup) is what is left.
    """
    rel = cg_path
    if mount_root != "/" and (rel == mount_root or rel.startswith(mount_root + "/")):
        rel = rel[len(mount_root) :]
    rel = rel.strip("/")
    dirs = []
    parts = rel.split("/") if rel else []
    for n in range(len(parts), -1, -1):
        d = os.path.join(mount_point, *parts[:n])
        if os.path.isdir(d):
            dirs.append(d)
    return dirs


def cgroup_paths(pid: int | str = "self") -> CgroupPaths:
    out = CgroupPaths()
    try:
        lines = read_path(f"/proc/{pid}/cgroup").decode("utf-8", "replace").splitlines()
    except OSError:
        return out
    v2_path = None
    v1_paths: dict[str, str] = {}
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2_path = path
        else:
            for c in controllers.split(","):
                v1_paths[c] = path
    mounts = _mounts()
    for ctrl, attr in (("cpu", "cpu"), ("memory", "memory")):
        for fstype, root, point, opts in mounts:
            if fstype == "cgroup" and ctrl in opts and ctrl in v1_paths:
                setattr(out, attr + "_version", 1)
                setattr(out, attr + "_dirs", _chain(point, root, v1_paths[ctrl]))
                break
            if fstype == "cgroup2" and v2_path is not None:
                ctl_file = os.path.join(point, "cgroup.controllers")
                try:
                    enabled = read_path(ctl_file).split()
                except OSError:
                    enabled = []
                if ctrl.encode() in enabled:
                    setattr(out, attr + "_version", 2)
                    setattr(out, attr + "_dirs", _chain(point, root, v2_path))
                    break
    versions = {v for v in (out.cpu_version, out.memory_version) if v is not None}
    if versions:
        out.version = min(versions) if len(versions) > 1 else versions.pop()
    elif v2_path is not None and any(m[0] == "cgroup2" for m in mounts):
        out.version = 2
    elif v1_paths:
        out.version = 1
    return out


def cgroup_cpu_quota(paths: CgroupPaths) -> float | None:
    """CPUs worth of CFS quota (the tightest along the hierarchy), ``None`` when unlimited."""
    best = None
    for d in paths.cpu_dirs:
        quota = period = None
        if paths.cpu_version == 2:
            text = read_text(os.path.join(d, "cpu.max"))
            if text:
                q, _, p = text.partition(" ")
                if q != "max" and p:
                    quota, period = int(q), int(p)
        else:
            q = read_text(os.path.join(d, "cpu.cfs_quota_us"))
            p = read_text(os.path.join(d, "cpu.cfs_period_us"))
            if q and p and int(q) > 0:
                quota, period = int(q), int(p)
        if quota is not None and period:
            cpus = quota / period
            best = cpus if best is None else min(best, cpus)
    return best


def cgroup_memory_limit(paths: CgroupPaths) -> int | None:
    """Memory limit in bytes (the tightest along the hierarchy), ``None`` when unlimited."""
    best = None
    name = "memory.max" if paths.memory_version == 2 else "memory.limit_in_bytes"
    for d in paths.memory_dirs:
        text = read_text(os.path.join(d, name))
        if not text or text == "max":
            continue
        try:
            limit = int(text)
        except ValueError:
            continue
        if limit < _NO_LIMIT:
            best = limit if best is None else min(best, limit)
    return best


def parse_cgroup_cpu_stat(data: bytes, version: int) -> tuple[int | None, float | None]:
    """(nr_throttled, throttled seconds) from a cgroup cpu.stat (v2 usec, v1 nsec)."""
    data = b"\n" + data
    nr = _find_int(data, b"\nnr_throttled ")
    if version == 2:
        us = _find_int(data, b"\nthrottled_usec ")
        return nr, (us / 1e6 if us is not None else None)
    ns = _find_int(data, b"\nthrottled_time ")
    return nr, (ns / 1e9 if ns is not None else None)
