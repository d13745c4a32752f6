"""Recordings for the report tests, written with the real RecordingWriter.

The figures follow a data-bound CPU training job on a 16-CPU machine: a trainer and four
DataLoader workers, steps of about 0.2 s of which 40 % waits for data, a swap spike, RAM that
grows slowly. GPU data, when asked for, is shaped like NVML's on an 80 GiB device.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.recording.records import DataLoaderRecord, JobEvent, SettingRecord, StepRecord
from torchdoctor.recording.writer import RecordingWriter
from torchdoctor.sampling.types import (
    CpuSplit,
    GpuProcessSample,
    GpuSample,
    HostSample,
    ProcessInfo,
    ProcessSample,
    Snapshot,
)

GIB = 1024**3
T0 = 1_790_000_000.0  # a fixed start, so figures in the report are reproducible
CPUS = 16
TRAINER = 4242


@dataclass
class Spec:
    seconds: float = 60.0
    interval: float = 0.5
    workers: int = 4
    gpus: int = 0
    nvml_reason: str = "NVML Shared Library Not Found"
    steps: bool = True
    swap_spike_at: float | None = 30.0  # one sample of heavy swap-out, seconds from the start
    swap_spike: float = 48e6  # bytes/s
    complete: bool = True
    command: tuple[str, ...] = (
        "python",
        "train.py",
        "--epochs",
        "3",
        "--data",
        "/data/imagenet subset",
    )
    gpu_name: str = "NVIDIA A100-SXM4-80GB"
    per_core: bool = True
    step_s: float = 0.2  # a step's shortest wall time; each adds up to 15 % at random
    seed: int = 7  # runs of one spec with different seeds differ as runs of one command do
    instrumentation_off_at: float | None = (
        None  # seconds from the start  # per-CPU splits (the heatmap); costly to write for long recordings
    )


def host_info() -> dict:
    return {
        "hostname": "trainbox-07",
        "kernel": "6.1.0-28-amd64",
        "cpu_model": "AMD EPYC 7543 32-Core Processor",
        "logical_cpus": CPUS,
        "physical_cores": 8,
        "allowed_cpus": list(range(CPUS)),
        "cgroup_version": 2,
        "cgroup_cpu_quota": None,
        "cgroup_memory_limit": None,
        "mem_total": 64 * GIB,
        "swap_total": 8 * GIB,
        "page_size": 4096,
    }


def gpu_status(spec: Spec) -> dict:
    if not spec.gpus:
        return {"available": False, "reason": spec.nvml_reason, "gpus": []}
    return {
        "available": True,
        "reason": None,
        "driver_version": "550.127.05",
        "cuda_driver_version": "12.4",
        "nvml_version": "12.550.127.05",
        "gpus": [
            {
                "index": i,
                "name": spec.gpu_name,
                "uuid": f"GPU-{i:08d}-0000-0000-0000-000000000000",
                "memory_total": 80 * GIB,
                "compute_capability": "8.0",
                "power_limit_w": 400.0,
            }
            for i in range(spec.gpus)
        ],
    }


def _core(core: int, busy: float, rng: random.Random) -> CpuSplit:
    """One CPU's split: the first six carry the trainer and its workers, the rest idle more."""
    load = min(99.0, busy * 1.5 + rng.random() * 8) if core < 6 else busy * 0.35 + rng.random() * 6
    return CpuSplit(load * 0.8, 0.0, load * 0.2, 100.0 - load - 1.0, 1.0, 0.0, 0.0, 0.0)


def write_recording(path: Path, spec: Spec | None = None) -> Path:
    """A recording at ``path`` following ``spec``; returns the path."""
    spec = spec or Spec()
    rng = random.Random(spec.seed)
    meta = {
        "torchdoctor_version": "0.1.0",
        "mode": "run",
        "command": list(spec.command),
        "cwd": "/home/ada/project",
        "root_pid": TRAINER,
        "started_at": T0,
        "interval_s": spec.interval,
        "instrumented": spec.steps,
        "host": host_info(),
        "gpus": gpu_status(spec),
        "torch_version": "2.13.0+cpu",
        "env": {"OMP_NUM_THREADS": "16", "CUDA_VISIBLE_DEVICES": "0"},
    }
    writer = RecordingWriter(path, meta, flush_every_s=3600)
    pids = [TRAINER] + [TRAINER + 10 + i for i in range(spec.workers)]
    infos = [
        ProcessInfo(
            TRAINER,
            4000,
            T0 - 0.2,
            "python",
            ["python", "train.py", "--epochs", "3"],
            "trainer",
            None,
        )
    ] + [
        ProcessInfo(
            pid,
            TRAINER,
            T0 + 1.0,
            "python",
            ["python", "train.py", "--epochs", "3"],
            "dataloader-worker",
            None,
        )
        for pid in pids[1:]
    ]
    n = int(spec.seconds / spec.interval)
    for k in range(n):
        t = T0 + k * spec.interval
        first = k == 0
        iowait = 1.0 + 0.8 * math.sin(k / 9) ** 2 + rng.random() * 0.5
        busy = 55.0 + 12 * math.sin(k / 15) + rng.random() * 6
        spike = (
            spec.swap_spike_at is not None and abs(t - T0 - spec.swap_spike_at) < spec.interval / 2
        )
        host = HostSample(
            t=t,
            cpu_busy=None if first else busy,
            cpu=None
            if first
            else CpuSplit(busy * 0.8, 0, busy * 0.2, 100 - busy - iowait, iowait, 0, 0, 0),
            per_core=None
            if first or not spec.per_core
            else [_core(c, busy, rng) for c in range(CPUS)],
            per_core_ids=None if first or not spec.per_core else list(range(CPUS)),
            load1=9.5,
            load5=8.0,
            load15=6.0,
            procs_running=10,
            procs_blocked=1,
            ctx_switches_per_s=None if first else 42000.0,
            mem_total=64 * GIB,
            mem_available=int((40 - 0.02 * k) * GIB),
            mem_used=int((24 + 0.02 * k) * GIB),
            swap_total=8 * GIB,
            swap_used=int(0.5 * GIB),
            swap_in_per_s=None if first else (2e6 if spike else 0.0),
            swap_out_per_s=None if first else (spec.swap_spike if spike else 0.0),
            major_faults_per_s=None if first else 3.0,
            disk_read_per_s=None if first else 120e6 + rng.random() * 40e6,
            disk_write_per_s=None if first else 2e6,
        )
        procs = []
        for i, pid in enumerate(pids):
            trainer = i == 0
            procs.append(
                ProcessSample(
                    t=t,
                    pid=pid,
                    ppid=infos[i].ppid,
                    create_time=infos[i].create_time,
                    name="python",
                    role=infos[i].role,
                    rank=None,
                    cpu_percent=None if first else (380.0 if trainer else 95.0) + rng.random() * 10,
                    cpu_user_s=k * 0.4,
                    cpu_system_s=k * 0.05,
                    rss=int((3.0 + 0.01 * k) * GIB) if trainer else int(1.9 * GIB),
                    pss=int((2.2 + 0.01 * k) * GIB) if trainer else int(0.6 * GIB),
                    uss=int(1.5 * GIB),
                    swap=0,
                    threads=24 if trainer else 17,
                    ctx_voluntary_per_s=None if first else 300.0,
                    ctx_involuntary_per_s=None if first else 40.0,
                    read_bytes_per_s=None if first else (0.0 if trainer else 28e6),
                    write_bytes_per_s=None if first else 0.0,
                )
            )
        gpus, gpu_procs = [], []
        for g in range(spec.gpus):
            gpus.append(
                GpuSample(
                    t=t,
                    index=g,
                    uuid=f"GPU-{g:08d}-0000-0000-0000-000000000000",
                    utilization_gpu=35.0 + 30 * math.sin(k / 5) ** 2,
                    utilization_memory=20.0,
                    memory_used=int((50 + 20 * min(1.0, k / 40)) * GIB),
                    memory_total=80 * GIB,
                    power_w=210.0,
                    power_limit_w=400.0,
                    temperature_c=61.0,
                    sm_clock_mhz=1410.0,
                    clock_event_reasons=[],
                    pcie_rx_per_s=2e9,
                    pcie_tx_per_s=1e8,
                )
            )
            gpu_procs.append(
                GpuProcessSample(
                    t, g, 90000 + TRAINER, TRAINER, int((48 + 20 * min(1.0, k / 40)) * GIB), True
                )
            )
        writer.write_snapshot(
            Snapshot(
                t=t,
                host=host,
                processes=procs,
                gpus=gpus,
                gpu_processes=gpu_procs,
                new_processes=infos if first else [],
            )
        )
    if spec.steps:
        steps, t_prev, step = [], T0 + 2.0, 0
        while t_prev < T0 + spec.seconds - 1:
            wait = 0.08 + rng.random() * 0.02
            wall = spec.step_s * (1 + rng.random() * 0.15)
            steps.append(
                StepRecord(
                    TRAINER,
                    None,
                    step,
                    t_prev,
                    t_prev + wall,
                    wall,
                    wait,
                    batch_size=64,
                    samples=64,
                )
            )
            t_prev += wall
            step += 1
        writer.add_steps(steps)
        writer.add_dataloaders(
            [
                DataLoaderRecord(
                    TRAINER,
                    None,
                    0,
                    T0 + 1.0,
                    64,
                    spec.workers,
                    False,
                    False,
                    2,
                    False,
                    None,
                    "ImageFolder",
                    120_000,
                    "RandomSampler",
                    first_batch_s=1.4,
                )
            ]
        )
        writer.add_settings(
            [
                SettingRecord(TRAINER, None, T0 + 0.5, "torch.num_threads", "16"),
                SettingRecord(TRAINER, None, T0 + 0.5, "torch.num_interop_threads", "16"),
                SettingRecord(TRAINER, None, T0 + 0.5, "env.OMP_NUM_THREADS", '"16"'),
                SettingRecord(TRAINER, None, T0 + 1.0, "optimizer.class", '"AdamW"'),
                SettingRecord(TRAINER, None, T0 + 1.0, "optimizer.lr", "0.001"),
            ]
        )
        writer.add_events(
            [
                JobEvent(
                    TRAINER,
                    None,
                    T0 + 2.0 + e * spec.seconds / 3,
                    "epoch-start",
                    f'{{"epoch": {e}}}',
                )
                for e in range(3)
            ]
        )
    if spec.instrumentation_off_at is not None:
        detail = '{"where": "optimizer.step", "error": "RuntimeError: patched twice"}'
        writer.add_events(
            [
                JobEvent(
                    TRAINER,
                    None,
                    T0 + spec.instrumentation_off_at,
                    "instrumentation-disabled",
                    detail,
                )
            ]
        )
    end = T0 + n * spec.interval
    writer.close({"ended_at": end, "exit_status": 0} if spec.complete else None)
    return path
