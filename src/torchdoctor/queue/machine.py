"""What the machine has right now, as the scheduler places jobs on it: GPUs (NVML), the CPUs
this user may use (the recorder's own definition: affinity capped by the cgroup quota), NUMA
nodes and available RAM."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.sampling import procfs
from torchdoctor.units import parse_cpu_list


@dataclass(slots=True)
class GpuState:
    index: int  # NVML's, i.e. PCI bus order
    uuid: str
    name: str
    total: int
    free: int  # NVML's free memory now
    numa_node: int | None = None
    # memory each process holds (PID in our namespace; NVML's PID when it cannot be mapped)
    processes: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class MachineState:
    gpus: list[GpuState]
    gpu_reason: str | None  # why no GPU is listed (no driver...), for messages
    cpus: list[int]  # CPUs jobs may be pinned to
    max_cores: int  # cores that may be handed out at once (cgroup quota)
    cpu_node: dict[int, int]  # CPU -> NUMA node
    mem_total: int
    mem_available: int
    # CPU -> share of it busy since the previous read (from /proc/stat); empty at the first
    cpu_busy: dict[int, float] = field(default_factory=dict)

    def gpu(self, uuid: str) -> GpuState | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


class MachineReader:
    """Reads the machine on demand; ``nvml_module`` as for GpuReader (None: ``pynvml``)."""

    def __init__(self, nvml_module: Any = None) -> None:
        from torchdoctor.sampling.gpus import GpuReader

        # The slow tier (power, clocks...) is of no use to placement: never read it.
        self._gpus = GpuReader(nvml_module, slow_refresh_s=math.inf)
        self._numa = {g.index: self._gpus.numa_node(g.index) for g in self._gpus.status.gpus}
        self._cpu_node = cpu_nodes()
        self._cpu_ticks: dict[int, tuple[int, ...]] = {}

    def read(self) -> MachineState:
        from torchdoctor.sampling.hostinfo import available_ram, read_host_info

        status = self._gpus.status
        gpus: list[GpuState] = []
        if status.available:
            _samples, processes = self._gpus.read(set())
            free = self._gpus.free_memory()
            for info in status.gpus:
                if info.uuid is None or info.memory_total is None or info.index not in free:
                    continue  # lost or unreadable: nothing can be placed there
                held: dict[int, int] = {}
                for p in processes:
                    if p.gpu_index == info.index:
                        pid = p.local_pid if p.local_pid is not None else p.pid
                        held[pid] = held.get(pid, 0) + (p.used_memory or 0)
                gpus.append(
                    GpuState(
                        info.index,
                        info.uuid,
                        info.name,
                        info.memory_total,
                        free[info.index],
                        self._numa.get(info.index),
                        held,
                    )
                )
        host = read_host_info()
        limit = host.cgroup_memory_limit
        total = min(host.mem_total, limit) if limit else host.mem_total
        mem_available = available_ram(host)
        return MachineState(
            gpus=gpus,
            gpu_reason=None if status.available else status.reason,
            cpus=list(host.allowed_cpus),
            max_cores=max(1, math.floor(host.usable_cpus)),
            cpu_node=self._cpu_node,
            mem_total=total,
            mem_available=min(mem_available, total),
            cpu_busy=self._busy(),
        )

    def _busy(self) -> dict[int, float]:
        """Each CPU's busy share since the last read: what anyone, the queue's jobs or not,
        kept it doing (1 - idle and I/O-wait ticks over all ticks)."""
        try:
            ticks = procfs.parse_proc_stat(procfs.read_path("/proc/stat", 1 << 20)).per_cpu
        except (OSError, ValueError):
            return {}
        busy = {}
        for cpu, now in ticks.items():
            before = self._cpu_ticks.get(cpu)
            if before is not None:
                total = sum(now) - sum(before)
                idle = (now[3] + now[4]) - (before[3] + before[4])
                if total > 0:
                    busy[cpu] = max(0.0, min(1.0, 1 - idle / total))
        self._cpu_ticks = ticks
        return busy

    def close(self) -> None:
        self._gpus.close()


def cpu_nodes(root: str = "/sys/devices/system/node") -> dict[int, int]:
    """CPU -> NUMA node from sysfs; every CPU on node 0 where sysfs has no nodes."""
    out: dict[int, int] = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return out
    for entry in entries:
        if entry.startswith("node") and entry[4:].isdigit():
            text = procfs.read_text(os.path.join(root, entry, "cpulist"))
            for cpu in parse_cpu_list(text or ""):
                out[cpu] = int(entry[4:])
    return out
