"""Plain data that the readers of the machine hand to the rest of torchdoctor.

Conventions, relied on by the recording and the diagnosis:
- times are UNIX seconds (float); sizes are bytes (int); rates are per second;
- counters that the kernel keeps (CPU seconds, bytes read, stall time) are also kept raw, as
  the cumulative value read (fields without ``_per_s``), for consumers that compute their own
  rates (Prometheus); they only go forward while their process or the machine lives;
- percentages are 0-100 of the whole (``HostSample.cpu_busy`` is the share of all allowed
  CPUs, ``ProcessSample.cpu_percent`` is psutil-style: 100 = one full core);
- a value that could not be read is ``None`` and the reason is kept in ``unavailable``
  (field name -> reason). ``None`` never means zero; zero is a measured zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CpuSplit:
    """Share (percent) of CPU time spent in each state over one sample interval."""

    user: float
    nice: float
    system: float
    idle: float
    iowait: float
    irq: float
    softirq: float
    steal: float

    @property
    def busy(self) -> float:
        return 100.0 - self.idle - self.iowait


@dataclass(slots=True)
class CpuTimes:
    """Cumulative CPU seconds since boot in each state, summed over every CPU of the machine."""

    user: float
    nice: float
    system: float
    idle: float
    iowait: float
    irq: float
    softirq: float
    steal: float


@dataclass(slots=True)
class HostSample:
    """One reading of the whole machine. Rates are ``None`` on the first reading."""

    t: float
    cpu_busy: float | None  # percent of all CPUs, excluding idle and iowait
    cpu: CpuSplit | None
    per_core: list[CpuSplit] | None
    load1: float
    load5: float
    load15: float
    procs_running: int  # run queue, /proc/stat procs_running
    procs_blocked: int  # tasks in uninterruptible (usually I/O) sleep
    ctx_switches_per_s: float | None
    mem_total: int
    mem_available: int
    mem_used: int  # total - available: what applications hold
    swap_total: int
    swap_used: int
    swap_in_per_s: float | None  # bytes/s, from pswpin pages
    swap_out_per_s: float | None
    major_faults_per_s: float | None
    disk_read_per_s: float | None  # bytes/s over whole disks (not partitions)
    disk_write_per_s: float | None
    psi_cpu_some: float | None = None  # avg10 percent, /proc/pressure/*
    psi_memory_some: float | None = None
    psi_memory_full: float | None = None
    psi_io_some: float | None = None
    psi_io_full: float | None = None
    cgroup_throttled_per_s: float | None = None  # share of wall time throttled (0-1 per s)
    cgroup_nr_throttled: int | None = None  # periods throttled since the previous sample
    per_core_ids: list[int] | None = None  # CPU number of each ``per_core`` entry (allowed CPUs)
    # The raw counters behind the rates above, cumulative since boot (whole machine).
    cpu_seconds: CpuTimes | None = None
    ctx_switches: int | None = None
    swap_in_bytes: int | None = None
    swap_out_bytes: int | None = None
    major_faults: int | None = None
    disk_read_bytes: int | None = None  # whole disks, as disk_read_per_s
    disk_written_bytes: int | None = None
    psi_cpu_some_s: float | None = None  # total stall seconds (PSI ``total=``)
    psi_memory_some_s: float | None = None
    psi_memory_full_s: float | None = None
    psi_io_some_s: float | None = None
    psi_io_full_s: float | None = None
    cgroup_throttled_s: float | None = None  # cumulative, the job's cgroup
    cgroup_throttled_periods: int | None = None
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class ProcessSample:
    """One process of the job at one time. Identity (``pid``, ``create_time``) is stable."""

    t: float
    pid: int
    ppid: int
    create_time: float
    name: str
    role: str  # "trainer", "dataloader-worker", "rank", "launcher", "other"
    rank: int | None  # RANK for distributed processes, else None
    cpu_percent: float | None  # 100 = one full core, over the interval since the last sample
    cpu_user_s: float  # cumulative
    cpu_system_s: float
    rss: int
    pss: int | None  # slow tier: may be a carried-over value from the last slow refresh
    uss: int | None
    swap: int | None  # VmSwap
    threads: int
    ctx_voluntary_per_s: float | None
    ctx_involuntary_per_s: float | None
    read_bytes_per_s: float | None
    write_bytes_per_s: float | None
    gpu_memory: int | None = None  # bytes on all GPUs, joined from NVML; None: unknown
    read_bytes: int | None = None  # cumulative /proc/<pid>/io, behind read_bytes_per_s
    write_bytes: int | None = None
    unavailable: dict[str, str] = field(default_factory=dict)
    # Shared memory (added later: a recording made before reads None, "not measured").
    # RssShmem: shared pages this process maps (a page mapped by two processes counts twice).
    shmem: int | None = None
    # Bytes of /dev/shm files this process holds open or mapped, each file counted once per
    # sample (on the first process of the job found holding it): the job's sum is the /dev/shm
    # space it needs.
    dev_shm: int | None = None
    # Seconds the process's main thread waited on a run queue, runnable but not given a CPU,
    # since it started (cumulative; /proc/<pid>/schedstat). Read for the processes that run
    # the model only: it tells a step starved of CPU by other programs from one that sleeps.
    run_delay_s: float | None = None


@dataclass(slots=True)
class ProcessInfo:
    """What is recorded once per process (the slow-changing part)."""

    pid: int
    ppid: int
    create_time: float
    name: str
    cmdline: list[str]
    role: str
    rank: int | None
    local_rank: int | None = None


@dataclass(slots=True)
class GpuSample:
    """One NVIDIA device at one time, read through NVML."""

    t: float
    index: int
    uuid: str | None
    utilization_gpu: float | None  # percent of the window in which a kernel was running
    utilization_memory: float | None  # percent of the window the memory bus was busy
    memory_used: int | None
    memory_total: int | None
    power_w: float | None
    power_limit_w: float | None
    temperature_c: float | None
    sm_clock_mhz: float | None
    clock_event_reasons: list[str] | None  # decoded throttle reasons, empty = none active
    pcie_rx_per_s: float | None  # bytes/s
    pcie_tx_per_s: float | None
    # ECC errors since the driver loaded (NVML's volatile counters); None on GPUs without ECC
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    # Xid errors (NVML critical-error events): the codes seen since the last sample, and how
    # many were seen since the reader started. None where the device cannot report them.
    xid_errors: list[int] | None = None
    xid_count: int | None = None
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class GpuProcessSample:
    """GPU memory of one process on one device; ``in_job`` tells whether it is ours."""

    t: float
    gpu_index: int
    pid: int  # as NVML reports it (host PID namespace)
    local_pid: int | None  # the PID in our namespace; None when it could not be resolved
    used_memory: int | None
    in_job: bool


@dataclass(slots=True)
class GpuInfo:
    """Static description of one device, recorded once in the run metadata."""

    index: int
    name: str
    uuid: str | None
    memory_total: int | None
    compute_capability: str | None
    power_limit_w: float | None
    unavailable: dict[str, str] = field(default_factory=dict)  # field name -> reason


@dataclass(slots=True)
class GpuStatus:
    """Whether NVML works at all; ``reason`` says why not (no driver, stub library...)."""

    available: bool
    reason: str | None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    # Why NVML's process PIDs (host PID namespace) cannot be joined to the job's PIDs here,
    # e.g. inside a container; None when they can. Per-process GPU memory is then unknown.
    process_pids_unresolved: str | None = None


@dataclass(slots=True)
class Snapshot:
    """Everything read at one sampling instant."""

    t: float
    host: HostSample | None
    processes: list[ProcessSample]
    gpus: list[GpuSample]
    gpu_processes: list[GpuProcessSample]
    new_processes: list[ProcessInfo] = field(default_factory=list)  # first seen this sample
    ended_pids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class HostInfo:
    """Static description of the machine, recorded once in the run metadata."""

    hostname: str
    kernel: str
    cpu_model: str | None
    logical_cpus: int
    physical_cores: int | None
    allowed_cpus: list[int]  # sched_getaffinity of the recorder
    cgroup_version: int | None  # 1, 2 or None when not in a cgroup we can read
    cgroup_cpu_quota: float | None  # CPUs worth of quota (cpu.max quota/period); None: no limit
    cgroup_memory_limit: int | None  # bytes; None: no limit
    mem_total: int
    swap_total: int
    page_size: int

    @property
    def usable_cpus(self) -> float:
        """CPUs the job can really use (see :func:`usable_cpus`)."""
        return usable_cpus(len(self.allowed_cpus), self.cgroup_cpu_quota, self.logical_cpus)


# The one rule for "how many CPUs can the job use", applied to the live machine (HostInfo) and
# to a recording's metadata (its "host" dict) alike: diagnosis, summary, report and tune all
# size their advice and their percentages with it.
def usable_cpus(allowed: int, cgroup_cpu_quota: float | None, logical_cpus: int | None) -> float:
    """CPUs a job can really use: the CPUs its affinity allows, capped by a cgroup CPU quota.

    A fractional quota stays fractional (0.5 CPU of quota is half a CPU: a job using half a
    CPU is saturated). Without a readable affinity the machine's logical CPUs count, and
    without either, one CPU.
    """
    n = float(allowed if allowed > 0 else logical_cpus or 1)
    if cgroup_cpu_quota:
        n = min(n, float(cgroup_cpu_quota))
    return n


def usable_cpus_of(host: Mapping[str, Any] | None) -> float | None:
    """:func:`usable_cpus` of a recording's ``meta["host"]``; None when the host was not recorded."""
    if not host:
        return None
    return usable_cpus(
        len(host.get("allowed_cpus") or []), host.get("cgroup_cpu_quota"), host.get("logical_cpus")
    )


def cpu_slots(usable: float) -> int:
    """Whole CPUs to place threads and workers on: a partial CPU of quota still runs a thread."""
    return max(1, math.ceil(usable - 1e-9))
