"""Plain readings for the view-model tests: the dataclasses the readers hand over."""

from __future__ import annotations

from torchdoctor.sampling.types import (
    CpuSplit,
    GpuInfo,
    GpuProcessSample,
    GpuSample,
    GpuStatus,
    HostSample,
    ProcessInfo,
    ProcessSample,
)
from torchdoctor.top.model import JobReading, TopReadings

GIB = 1024**3
T = 1_796_000_000.0


def split(user=10.0, system=5.0, iowait=0.0, idle=None) -> CpuSplit:
    idle = 100.0 - user - system - iowait if idle is None else idle
    return CpuSplit(user, 0.0, system, idle, iowait, 0.0, 0.0, 0.0)


def host(cores=4, user=10.0, system=5.0, iowait=0.0, swap_in=0.0, swap_out=0.0) -> HostSample:
    cpu = split(user, system, iowait)
    return HostSample(
        t=T,
        cpu_busy=cpu.busy,
        cpu=cpu,
        per_core=[split(user, system, iowait) for _ in range(cores)],
        load1=1.0,
        load5=0.5,
        load15=0.25,
        procs_running=2,
        procs_blocked=0,
        ctx_switches_per_s=1000.0,
        mem_total=32 * GIB,
        mem_available=20 * GIB,
        mem_used=12 * GIB,
        swap_total=2 * GIB,
        swap_used=0,
        swap_in_per_s=swap_in,
        swap_out_per_s=swap_out,
        major_faults_per_s=0.0,
        disk_read_per_s=0.0,
        disk_write_per_s=0.0,
        psi_cpu_some=1.5,
        psi_memory_some=0.0,
        psi_io_some=0.2,
    )


def proc(
    pid, ppid, role="trainer", rank=None, cpu=10.0, rss=GIB, pss=None, vram=None, name="python"
):
    return ProcessSample(
        t=T,
        pid=pid,
        ppid=ppid,
        create_time=T - 100,
        name=name,
        role=role,
        rank=rank,
        cpu_percent=cpu,
        cpu_user_s=1.0,
        cpu_system_s=0.1,
        rss=rss,
        pss=pss if pss is not None else rss // 2,
        uss=rss // 4,
        swap=0,
        threads=4 if role != "dataloader-worker" else 1,
        ctx_voluntary_per_s=None,
        ctx_involuntary_per_s=None,
        read_bytes_per_s=None,
        write_bytes_per_s=None,
        gpu_memory=vram,
    )


def job(root, processes, cmd=("python", "train.py"), recording=None) -> JobReading:
    info = {
        p.pid: ProcessInfo(p.pid, p.ppid, p.create_time, p.name, list(cmd), p.role, p.rank)
        for p in processes
    }
    return JobReading(root_pid=root, processes=processes, info=info, recording=recording)


def gpu(index=0, used=10 * GIB, total=80 * GIB, util=50.0, reasons=None) -> GpuSample:
    return GpuSample(
        t=T,
        index=index,
        uuid=f"GPU-{index}",
        utilization_gpu=util,
        utilization_memory=20.0,
        memory_used=used,
        memory_total=total,
        power_w=250.0,
        power_limit_w=400.0,
        temperature_c=60.0,
        sm_clock_mhz=1410.0,
        clock_event_reasons=reasons if reasons is not None else [],
        pcie_rx_per_s=0.0,
        pcie_tx_per_s=0.0,
    )


def gpu_status(n=1) -> GpuStatus:
    return GpuStatus(
        available=True,
        reason=None,
        driver_version="550.54.15",
        gpus=[
            GpuInfo(i, "NVIDIA A100-SXM4-80GB", f"GPU-{i}", 80 * GIB, "8.0", 400.0)
            for i in range(n)
        ],
    )


NO_GPU = GpuStatus(available=False, reason="no NVIDIA driver: libnvidia-ml.so.1 not found")


def readings(
    jobs=(), host_sample=None, status=NO_GPU, gpus=(), gpu_procs=(), cores=4
) -> TopReadings:
    return TopReadings(
        t=T,
        interval_s=1.0,
        hostname="box",
        host=host_sample if host_sample is not None else host(cores=cores),
        usable_cpus=cores,
        gpu_status=status,
        gpus=list(gpus),
        gpu_processes=list(gpu_procs),
        jobs=list(jobs),
    )


def gpu_proc(pid, used, index=0, local=True, in_job=True) -> GpuProcessSample:
    return GpuProcessSample(
        t=T,
        gpu_index=index,
        pid=pid,
        local_pid=pid if local else None,
        used_memory=used,
        in_job=in_job,
    )
