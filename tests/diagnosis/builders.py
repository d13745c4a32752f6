"""Recordings for rule tests, written with the real RecordingWriter from realistic figures.

A :class:`Job` describes a run as functions of the time since its start (host load, each
process's CPU and memory, GPU readings) plus the in-job records (steps, DataLoaders,
settings, events); :meth:`Job.write` samples it every ``interval`` seconds like the recorder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchdoctor.recording.records import DataLoaderRecord, JobEvent, SettingRecord, StepRecord
from torchdoctor.recording.writer import RecordingWriter
from torchdoctor.sampling.types import (
    CpuSplit,
    GpuInfo,
    GpuProcessSample,
    GpuSample,
    GpuStatus,
    HostInfo,
    HostSample,
    ProcessInfo,
    ProcessSample,
    Snapshot,
)

GiB = 2**30
MiB = 2**20
T0 = 1_764_489_600.0  # 2025-11-30 08:00 UTC

Fn = Callable[[float], float]


def const(v: float) -> Fn:
    return lambda t: v


@dataclass
class Proc:
    pid: int
    role: str = "trainer"
    name: str = "python"
    cpu: Fn = const(95.0)  # percent, 100 = one core
    rss: Fn = const(1.2 * GiB)
    uss: Fn | None = None  # None: not measured
    threads: int = 6
    involuntary: Fn = const(20.0)
    voluntary: Fn = const(50.0)
    read: Fn = const(0.0)
    write: Fn = const(0.0)
    gpu_memory: Fn | None = None
    shm: Fn | None = None  # bytes of shared memory (RssShmem and /dev/shm files alike)
    start: float = 0.0  # seconds after the job start
    end: float | None = None


@dataclass
class Gpu:
    index: int = 0
    name: str = "NVIDIA A100-SXM4-80GB"
    total: int = 80 * GiB
    capability: str = "8.0"
    util: Fn = const(95.0)
    used: Fn = const(50 * GiB)
    reasons: Callable[[float], list[str]] = lambda t: []
    temperature: Fn = const(62.0)
    clock: Fn = const(1410.0)
    power: Fn = const(300.0)
    power_limit: float = 400.0
    job_pid: int | None = 1000  # the job process holding memory on it (None: not the job's)
    xids: Callable[[float], list[int]] = lambda t: []  # Xid codes seen since the last sample
    ecc_uncorrected: Callable[[float], int | None] = lambda t: 0


@dataclass
class Job:
    cpus: int = 8
    quota: float | None = None
    duration: float = 40.0
    interval: float = 0.5
    mem_total: int = 32 * GiB
    swap_total: int = 0
    cgroup_memory_limit: int | None = None
    procs: list[Proc] = field(default_factory=lambda: [Proc(1000)])
    gpus: list[Gpu] = field(default_factory=list)
    gpu_available: bool | None = None  # default: True when gpus are given
    host: Callable[[float], dict[str, Any]] = lambda t: {}
    steps: list[StepRecord] = field(default_factory=list)
    dataloaders: list[DataLoaderRecord] = field(default_factory=list)
    settings: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[JobEvent] = field(default_factory=list)
    end: dict[str, Any] = field(default_factory=dict)  # more of the recording's end meta

    def meta(self) -> dict[str, Any]:
        host = HostInfo(
            hostname="trainbox",
            kernel="6.1.0",
            cpu_model="AMD EPYC 7B13",
            logical_cpus=self.cpus,
            physical_cores=self.cpus,
            allowed_cpus=list(range(self.cpus)),
            cgroup_version=2,
            cgroup_cpu_quota=self.quota,
            cgroup_memory_limit=self.cgroup_memory_limit,
            mem_total=self.mem_total,
            swap_total=self.swap_total,
            page_size=4096,
        )
        available = bool(self.gpus) if self.gpu_available is None else self.gpu_available
        status = GpuStatus(
            available=available,
            reason=None if available else "NVML library not found (no NVIDIA driver)",
            driver_version="550.54.15" if available else None,
            gpus=[
                GpuInfo(g.index, g.name, f"GPU-{g.index:08x}", g.total, g.capability, g.power_limit)
                for g in self.gpus
            ],
        )
        return {
            "command": ["python", "train.py"],
            "host": dataclasses.asdict(host),
            "gpus": dataclasses.asdict(status),
            "env": {},
            "started_at": T0,
        }

    def write(self, path: Path) -> Path:
        writer = RecordingWriter(path, self.meta(), flush_every_s=3600)
        seen: set[int] = set()
        n = int(round(self.duration / self.interval))
        for i in range(1, n + 1):
            rel = i * self.interval
            writer.write_snapshot(self._snapshot(rel, seen))
        writer.add_steps(self.steps)
        writer.add_dataloaders(self.dataloaders)
        writer.add_settings(
            SettingRecord(pid, None, T0 + 0.5, key, _json(value))
            for pid, values in self.settings.items()
            for key, value in values.items()
        )
        writer.add_events(self.events)
        writer.close({"ended_at": T0 + self.duration, "exit_status": 0, **self.end})
        return path

    def _snapshot(self, rel: float, seen: set[int]) -> Snapshot:
        t = T0 + rel
        alive = [p for p in self.procs if p.start <= rel and (p.end is None or rel <= p.end)]
        new = [p for p in alive if p.pid not in seen]
        seen.update(p.pid for p in new)
        processes = [
            ProcessSample(
                t=t,
                pid=p.pid,
                ppid=1 if p.role == "trainer" else self.procs[0].pid,
                create_time=T0 + p.start,
                name=p.name,
                role=p.role,
                rank=None,
                cpu_percent=p.cpu(rel),
                cpu_user_s=p.cpu(rel) / 100 * rel * 0.9,
                cpu_system_s=p.cpu(rel) / 100 * rel * 0.1,
                rss=int(p.rss(rel)),
                pss=int(p.uss(rel) * 1.1) if p.uss else None,
                uss=int(p.uss(rel)) if p.uss else None,
                swap=0,
                threads=p.threads,
                ctx_voluntary_per_s=p.voluntary(rel),
                ctx_involuntary_per_s=p.involuntary(rel),
                read_bytes_per_s=p.read(rel),
                write_bytes_per_s=p.write(rel),
                gpu_memory=int(p.gpu_memory(rel)) if p.gpu_memory else (0 if self.gpus else None),
                shmem=int(p.shm(rel)) if p.shm else None,
                dev_shm=int(p.shm(rel)) if p.shm else None,
            )
            for p in alive
        ]
        job_cores = sum(p.cpu(rel) for p in alive) / 100
        busy = min(100.0, job_cores / self.cpus * 100 + 2.0)
        values: dict[str, Any] = {
            "cpu_busy": busy,
            "iowait": 0.2,
            "load1": job_cores,
            "procs_running": max(1, round(job_cores)) + 1,
            "procs_blocked": 0,
            "mem_available": self.mem_total - sum(p.rss(rel) for p in alive) - 2 * GiB,
            "swap_used": 0,
            "swap_in_per_s": 0.0,
            "swap_out_per_s": 0.0,
            "major_faults_per_s": 0.0,
            "disk_read_per_s": sum(p.read(rel) for p in alive) + 4096.0,
            "disk_write_per_s": sum(p.write(rel) for p in alive) + 40960.0,
            "cgroup_throttled_per_s": 0.0,
            "psi_io_some": 0.0,
        }
        values.update(self.host(rel))
        busy, iowait = values["cpu_busy"], values["iowait"]
        split = CpuSplit(
            user=busy * 0.9,
            nice=0.0,
            system=busy * 0.1,
            idle=max(100.0 - busy - iowait, 0.0),
            iowait=iowait,
            irq=0.0,
            softirq=0.0,
            steal=0.0,
        )
        host = HostSample(
            t=t,
            cpu_busy=busy,
            cpu=split,
            per_core=None,
            load1=values["load1"],
            load5=values["load1"],
            load15=values["load1"],
            procs_running=int(values["procs_running"]),
            procs_blocked=int(values["procs_blocked"]),
            ctx_switches_per_s=5000.0,
            mem_total=self.mem_total,
            mem_available=int(values["mem_available"]),
            mem_used=int(self.mem_total - values["mem_available"]),
            swap_total=self.swap_total,
            swap_used=int(values["swap_used"]),
            swap_in_per_s=values["swap_in_per_s"],
            swap_out_per_s=values["swap_out_per_s"],
            major_faults_per_s=values["major_faults_per_s"],
            disk_read_per_s=values["disk_read_per_s"],
            disk_write_per_s=values["disk_write_per_s"],
            psi_io_some=values["psi_io_some"],
            cgroup_throttled_per_s=values["cgroup_throttled_per_s"],
        )
        gpus = [
            GpuSample(
                t=t,
                index=g.index,
                uuid=f"GPU-{g.index:08x}",
                utilization_gpu=g.util(rel),
                utilization_memory=g.util(rel) / 2,
                memory_used=int(g.used(rel)),
                memory_total=g.total,
                power_w=g.power(rel),
                power_limit_w=g.power_limit,
                temperature_c=g.temperature(rel),
                sm_clock_mhz=g.clock(rel),
                clock_event_reasons=g.reasons(rel),
                pcie_rx_per_s=1e8,
                pcie_tx_per_s=1e7,
                ecc_corrected=0,
                ecc_uncorrected=g.ecc_uncorrected(rel),
                xid_errors=g.xids(rel),
            )
            for g in self.gpus
        ]
        gpu_procs = [
            GpuProcessSample(t, g.index, g.job_pid, g.job_pid, int(g.used(rel) - 500 * MiB), True)
            for g in self.gpus
            if g.job_pid is not None
        ]
        infos = [
            ProcessInfo(p.pid, 1, T0 + p.start, p.name, ["python", "train.py"], p.role, None)
            for p in new
        ]
        return Snapshot(t, host, processes, gpus, gpu_procs, new_processes=infos)


def make_steps(
    pid: int = 1000,
    *,
    n: int = 200,
    wall: float = 0.1,
    wait: float = 0.005,
    start: float = 2.0,
    batch: int | None = 64,
    wait_fn: Callable[[int], float] | None = None,
    **extra: Any,
) -> list[StepRecord]:
    """``n`` back-to-back steps from ``start`` seconds after the job start."""
    steps = []
    t = T0 + start
    for i in range(n):
        w = wait_fn(i) if wait_fn else wait
        step_wall = wall - wait + w
        values = {k: (v(i) if callable(v) else v) for k, v in extra.items()}
        steps.append(
            StepRecord(
                pid=pid,
                rank=None,
                step=i,
                t_start=t,
                t_end=t + step_wall,
                wall_s=step_wall,
                data_wait_s=w,
                batch_size=batch,
                samples=batch,
                **values,
            )
        )
        t += step_wall
    return steps


def loader(pid: int = 1000, **kw: Any) -> DataLoaderRecord:
    values = dict(
        pid=pid,
        rank=None,
        loader_id=0,
        t=T0 + 1.0,
        batch_size=64,
        num_workers=0,
        pin_memory=False,
        persistent_workers=False,
        prefetch_factor=None,
        drop_last=False,
        multiprocessing_context=None,
        dataset_type="ImageFolder",
        dataset_len=50_000,
        sampler_type="RandomSampler",
        first_batch_s=0.05,
    )
    values.update(kw)
    return DataLoaderRecord(**values)


def _json(value: Any) -> str:
    import json

    return json.dumps(value)
