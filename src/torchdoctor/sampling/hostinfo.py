"""The static description of the machine, recorded once per run."""

from __future__ import annotations

import os

from torchdoctor.sampling import procfs
from torchdoctor.sampling.types import HostInfo


def _cpu_model() -> str | None:
    try:
        text = procfs.read_path("/proc/cpuinfo", 65536).decode("utf-8", "replace")
    except OSError:
        return None
    # x86 says "model name"; some ARM kernels only give "Hardware" or "Processor".
    for key in ("model name", "Hardware", "Processor", "cpu model"):
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return value.strip()
    return None


def _physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except Exception:  # psutil raises odd errors on exotic /sys layouts; the count is optional
        return None


def read_host_info(pid: int | None = None) -> HostInfo:
    """Describe the machine; ``pid`` picks whose affinity and cgroup limits are recorded
    (default: this process)."""
    target = pid if pid is not None else os.getpid()
    try:
        allowed = sorted(os.sched_getaffinity(target))
    except OSError:
        allowed = sorted(os.sched_getaffinity(0))
    paths = procfs.cgroup_paths(target)
    try:
        meminfo = procfs.read_path("/proc/meminfo")
    except OSError:
        meminfo = b""
    mem_total, _avail, swap_total, _free = procfs.parse_meminfo_fields(meminfo)
    uname = os.uname()
    return HostInfo(
        hostname=uname.nodename,
        kernel=uname.release,
        cpu_model=_cpu_model(),
        logical_cpus=os.cpu_count() or len(allowed),
        physical_cores=_physical_cores(),
        allowed_cpus=allowed,
        cgroup_version=paths.version,
        cgroup_cpu_quota=procfs.cgroup_cpu_quota(paths),
        cgroup_memory_limit=procfs.cgroup_memory_limit(paths),
        mem_total=mem_total or 0,
        swap_total=swap_total or 0,
        page_size=procfs.PAGE_SIZE,
    )


def whole_cpus_here(pid: int | None = None) -> int:
    """Whole CPUs this process (or ``pid``) may place threads and workers on: the usable-CPU
    rule (:func:`~torchdoctor.sampling.types.usable_cpus`) on the live machine, a partial CPU
    of quota counting as one. The one helper launch, tune and doctor size threads with."""
    from torchdoctor.sampling.types import cpu_slots

    return cpu_slots(read_host_info(pid).usable_cpus)


def available_ram(host: HostInfo | None = None) -> int:
    """Bytes of RAM a new allocation can get now: the kernel's MemAvailable, at most the
    memory limit of this process's cgroup (a container with a 4 GiB limit cannot use the
    host's 100 GiB, however much of it is free). ``host`` gives the limit already read.

    The one free-RAM rule: the queue's placement, ``estimate``'s fit check and ``tune``'s
    memory budget and guard all read this.
    """
    try:
        meminfo = procfs.read_path("/proc/meminfo")
    except OSError:
        meminfo = b""
    _total, available, _swap, _swap_free = procfs.parse_meminfo_fields(meminfo)
    if available is None:  # no MemAvailable (a kernel before 3.14): psutil estimates it
        import psutil

        available = int(psutil.virtual_memory().available)
    if host is not None:
        limit = host.cgroup_memory_limit
    else:
        limit = procfs.cgroup_memory_limit(procfs.cgroup_paths(os.getpid()))
    return min(available, limit) if limit else available
