"""The machine as a whole: CPU, memory, swap, disks, pressure and cgroup throttling."""

from __future__ import annotations

import os
import time

from torchdoctor.sampling import procfs
from torchdoctor.sampling.types import CpuSplit, CpuTimes, HostSample

_VMSTAT_KEYS = (b"pswpin", b"pswpout", b"pgmajfault")
_PSI = ("cpu", "memory", "io")


class _Src:
    """One file kept open between reads; remembers why it could not be opened."""

    __slots__ = ("path", "fd", "error", "multi")

    def __init__(self, path: str, multi: bool = False) -> None:
        self.path = path
        self.multi = multi
        self.fd: int | None = None
        self.error: str | None = None
        try:
            self.fd = procfs.open_ro(path)
        except OSError as e:
            self.error = f"{path}: {e.strerror or e}"

    def read(self) -> bytes | None:
        if self.fd is None:
            return None
        try:
            if self.multi:
                return procfs.pread_all(self.fd)
            return procfs.pread_single(self.fd, 16384)
        except OSError as e:
            # PSI files exist but fail with EOPNOTSUPP when the kernel runs with psi=0.
            self.error = f"{self.path}: {e.strerror or e}"
            self.close()
            return None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _split(now: tuple[int, ...], before: tuple[int, ...]) -> CpuSplit | None:
    d = [a - b for a, b in zip(now, before, strict=True)]
    total = sum(d)
    if total <= 0:
        return None
    k = 100.0 / total
    return CpuSplit(*(max(0.0, x * k) for x in d))


class HostReader:
    """Reads the host once per ``read()``; rates are deltas against the previous read.

    ``pid`` picks whose CPU affinity and cgroup are followed (default: this process); pass the
    job's root PID so the allowed CPUs and the throttling are the job's.
    """

    def __init__(self, pid: int | None = None) -> None:
        self._pid = pid if pid is not None else os.getpid()
        self._stat = _Src("/proc/stat")
        if self._stat.fd is None:
            raise OSError(
                f"cannot read /proc/stat ({self._stat.error}); torchdoctor needs Linux /proc"
            )
        self._meminfo = _Src("/proc/meminfo")
        self._loadavg = _Src("/proc/loadavg")
        self._vmstat = _Src("/proc/vmstat", multi=True)
        self._diskstats = _Src("/proc/diskstats", multi=True)
        self._psi = {name: _Src(f"/proc/pressure/{name}") for name in _PSI}
        self._disk_class: dict[str, bool] = {}
        self._disks: set[str] = set()
        self._init_cgroup()
        try:
            self.allowed_cpus = sorted(os.sched_getaffinity(self._pid))
        except OSError:
            self.allowed_cpus = sorted(os.sched_getaffinity(0))
        self._prev: tuple | None = None

    def _init_cgroup(self) -> None:
        paths = procfs.cgroup_paths(self._pid)
        self._cg_version = paths.cpu_version
        self._cg_stat: _Src | None = None
        self._cg_error = "no cgroup cpu controller found for the process"
        if paths.cpu_dirs and paths.cpu_version is not None:
            src = _Src(os.path.join(paths.cpu_dirs[0], "cpu.stat"))
            if src.fd is not None:
                self._cg_stat = src
            else:
                self._cg_error = src.error or self._cg_error

    def close(self) -> None:
        for src in (self._stat, self._meminfo, self._loadavg, self._vmstat, self._diskstats):
            src.close()
        for src in self._psi.values():
            src.close()
        if self._cg_stat is not None:
            self._cg_stat.close()

    def _classify_disks(self, names: set[str]) -> None:
        changed = False
        for name in names:
            if name not in self._disk_class:
                self._disk_class[name] = procfs.is_whole_physical_disk(name)
                changed = True
        if changed:
            self._disks = {n for n, whole in self._disk_class.items() if whole}

    def read(self) -> HostSample:
        t = time.time()
        mono = time.monotonic()
        unavailable: dict[str, str] = {}

        stat = procfs.parse_proc_stat(self._stat.read() or b"")
        cores = [stat.per_cpu[c] for c in self.allowed_cpus if c in stat.per_cpu]
        # The share of the CPUs this job may use: sum the allowed cores (all of them when no
        # affinity is set, which equals the aggregate "cpu" line).
        cpu_total = tuple(map(sum, zip(*cores, strict=True))) if cores else stat.total

        meminfo = self._meminfo.read()
        mem_total, mem_avail, swap_total, swap_free = procfs.parse_meminfo_fields(meminfo or b"")
        load = procfs.parse_loadavg(self._loadavg.read() or b"0 0 0")

        vm = self._vmstat.read()
        pswpin, pswpout, majflt = procfs.parse_vmstat_fields(vm or b"", _VMSTAT_KEYS)

        disk = self._diskstats.read()
        sectors_r = sectors_w = None
        if disk is not None:
            sectors_r, sectors_w, names = procfs.parse_diskstats(disk, self._disks)
            if names - self._disk_class.keys():
                self._classify_disks(names)
                sectors_r, sectors_w, _ = procfs.parse_diskstats(disk, self._disks)
        else:
            why = self._diskstats.error or "no /proc/diskstats"
            for f in (
                "disk_read_per_s",
                "disk_write_per_s",
                "disk_read_bytes",
                "disk_written_bytes",
            ):
                unavailable[f] = why

        psi: dict[str, tuple[float | None, float | None]] = {}
        psi_s: dict[str, tuple[float | None, float | None]] = {}
        for name, src in self._psi.items():
            data = src.read()
            if data is None:
                psi[name] = psi_s[name] = (None, None)
                reason = src.error or "not available"
                fields = (
                    ["psi_cpu_some"] if name == "cpu" else [f"psi_{name}_some", f"psi_{name}_full"]
                )
                for f in fields:
                    unavailable[f] = unavailable[f"{f}_s"] = reason
            else:
                psi[name] = procfs.parse_pressure(data)
                psi_s[name] = procfs.parse_pressure_totals(data)

        nr_throttled = throttled_s = None
        cg_reason = self._cg_error
        if self._cg_stat is not None and self._cg_version is not None:
            data = self._cg_stat.read()
            if data is not None:
                nr_throttled, throttled_s = procfs.parse_cgroup_cpu_stat(data, self._cg_version)
                # v2 lists throttling only where the cpu controller is enabled.
                cg_reason = f"{self._cg_stat.path} has no throttling counters"
            else:
                cg_reason = self._cg_stat.error or cg_reason
        if nr_throttled is None:
            for f in (
                "cgroup_throttled_per_s",
                "cgroup_nr_throttled",
                "cgroup_throttled_s",
                "cgroup_throttled_periods",
            ):
                unavailable[f] = cg_reason

        now = (
            mono,
            cpu_total,
            {c: stat.per_cpu.get(c) for c in self.allowed_cpus},
            stat.ctxt,
            pswpin,
            pswpout,
            majflt,
            sectors_r,
            sectors_w,
            nr_throttled,
            throttled_s,
        )
        prev = self._prev
        self._prev = now

        cpu = per_core = None
        ctx_rate = swin = swout = majrate = d_read = d_write = thr_rate = nr_delta = None
        if prev is not None:
            dt = mono - prev[0]
            if cpu_total is not None and prev[1] is not None:
                cpu = _split(cpu_total, prev[1])
            per_core = []
            for c in self.allowed_cpus:
                a, b = now[2].get(c), prev[2].get(c)
                s = _split(a, b) if a is not None and b is not None else None
                # A core with no ticks in the window (offline) reads as fully idle.
                per_core.append(s or CpuSplit(0.0, 0.0, 0.0, 100.0, 0.0, 0.0, 0.0, 0.0))
            if dt > 0:
                ctx_rate = _rate(stat.ctxt, prev[3], dt)
                swin = _rate(pswpin, prev[4], dt, procfs.PAGE_SIZE)
                swout = _rate(pswpout, prev[5], dt, procfs.PAGE_SIZE)
                majrate = _rate(majflt, prev[6], dt)
                d_read = _rate(sectors_r, prev[7], dt, procfs.SECTOR_SIZE)
                d_write = _rate(sectors_w, prev[8], dt, procfs.SECTOR_SIZE)
                if throttled_s is not None and prev[10] is not None:
                    thr_rate = max(0.0, (throttled_s - prev[10]) / dt)
            if nr_throttled is not None and prev[9] is not None:
                nr_delta = max(0, nr_throttled - prev[9])
        for names, value, why in (
            (("ctx_switches_per_s", "ctx_switches"), stat.ctxt, "no ctxt line in /proc/stat"),
            (("swap_in_per_s", "swap_in_bytes"), pswpin, "no pswpin in /proc/vmstat"),
            (("swap_out_per_s", "swap_out_bytes"), pswpout, "no pswpout in /proc/vmstat"),
            (("major_faults_per_s", "major_faults"), majflt, "no pgmajfault in /proc/vmstat"),
        ):
            if value is None:
                for name in names:
                    unavailable[name] = why

        # The machine's own counters (all CPUs, not only the job's), as node_exporter reads them.
        cpu_seconds = (
            CpuTimes(*(ticks / procfs.CLK_TCK for ticks in stat.total))
            if stat.total is not None
            else None
        )
        mem_total = mem_total or 0
        mem_avail = mem_avail if mem_avail is not None else mem_total
        return HostSample(
            t=t,
            cpu_busy=cpu.busy if cpu is not None else None,
            cpu=cpu,
            per_core=per_core,
            load1=load[0],
            load5=load[1],
            load15=load[2],
            procs_running=stat.procs_running or 0,
            procs_blocked=stat.procs_blocked or 0,
            ctx_switches_per_s=ctx_rate,
            mem_total=mem_total,
            mem_available=mem_avail,
            mem_used=mem_total - mem_avail,
            swap_total=swap_total or 0,
            swap_used=(swap_total or 0) - (swap_free or 0),
            swap_in_per_s=swin,
            swap_out_per_s=swout,
            major_faults_per_s=majrate,
            disk_read_per_s=d_read,
            disk_write_per_s=d_write,
            psi_cpu_some=psi["cpu"][0],
            psi_memory_some=psi["memory"][0],
            psi_memory_full=psi["memory"][1],
            psi_io_some=psi["io"][0],
            psi_io_full=psi["io"][1],
            cgroup_throttled_per_s=thr_rate,
            cgroup_nr_throttled=nr_delta,
            per_core_ids=list(self.allowed_cpus),
            cpu_seconds=cpu_seconds,
            ctx_switches=stat.ctxt,
            swap_in_bytes=_scaled(pswpin, procfs.PAGE_SIZE),
            swap_out_bytes=_scaled(pswpout, procfs.PAGE_SIZE),
            major_faults=majflt,
            disk_read_bytes=_scaled(sectors_r, procfs.SECTOR_SIZE),
            disk_written_bytes=_scaled(sectors_w, procfs.SECTOR_SIZE),
            psi_cpu_some_s=psi_s["cpu"][0],
            psi_memory_some_s=psi_s["memory"][0],
            psi_memory_full_s=psi_s["memory"][1],
            psi_io_some_s=psi_s["io"][0],
            psi_io_full_s=psi_s["io"][1],
            cgroup_throttled_s=throttled_s,
            cgroup_throttled_periods=nr_throttled,
            unavailable=unavailable,
        )


def _scaled(count: int | None, scale: int) -> int | None:
    return None if count is None else count * scale


def _rate(now: float | None, before: float | None, dt: float, scale: int = 1) -> float | None:
    if now is None or before is None:
        return None
    # Counters only go forward; a wrap or reset reads as zero rather than a negative rate.
    return max(0.0, (now - before) * scale / dt)
