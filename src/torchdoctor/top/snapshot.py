"""``torchdoctor top --once --json``: one snapshot as a documented JSON object.

Schema ``torchdoctor-top/1`` (sizes in bytes, rates per second, percentages 0-100, times UNIX
seconds; ``null`` means "could not be read", with the reason in the nearest ``unavailable``)::

    schema          "torchdoctor-top/1"
    t, hostname, interval_s   when, where, and the window rates are measured over
    thresholds      the threshold table in force (defaults + overrides)
    host            HostSample fields (cpu_busy, cpu{user,system,iowait...}, per_core[...],
                    load1/5/15, procs_running (run queue), procs_blocked, mem_*, swap_*,
                    swap_in_per_s/swap_out_per_s, psi_*, unavailable) and
                    levels{cpu_load_pct, iowait_pct, swap_bytes_per_s}: "ok" | "warn" | "alert"
    gpu             {available, reason, driver_version, cuda_driver_version,
                    pids_unresolved_reason}: reason says why no GPU is shown
    gpus[]          GpuSample fields + name, memory_pct, level (of memory_pct)
    gpu_processes[] {gpu_index, pid (NVML, host namespace), local_pid (null: unresolved here),
                    resolved, used_memory, job (root PID of the PyTorch job, or null)}
    jobs[]          {root_pid, command, ranks[], workers, cpu_percent, threads, rss, pss,
                    gpu_memory, status, status_level, recording, processes[]}
                    recording: null unless the job runs under `torchdoctor run`, else
                    {path, steps, step_rate_per_s, samples_per_s, data_wait_share (0-1),
                    rate_lower_bound (an attached job's sampled steps merge: the rate is at
                    least this), findings[{id, severity, title, recommendation}], unavailable}
                    processes[]: in tree order, {pid, ppid, depth, role ("trainer",
                    "dataloader-worker", "launcher", "other"), rank, name, cmdline[],
                    cpu_percent (100 = one core), threads, rss, pss, uss, swap, gpu_memory,
                    unavailable}
    notes[]         what could not be seen (e.g. other users' processes)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchdoctor.thresholds import Thresholds
from torchdoctor.top.model import TopReadings, View

SCHEMA = "torchdoctor-top/1"


def snapshot(readings: TopReadings, view: View, thresholds: Thresholds) -> dict[str, Any]:
    host = None
    if readings.host is not None and view.host is not None:
        host = dataclasses.asdict(readings.host)
        host["levels"] = {
            "cpu_load_pct": view.host.cpu_level,
            "iowait_pct": view.host.iowait_level,
            "swap_bytes_per_s": view.host.swap_level,
        }
    status = readings.gpu_status
    gpus = []
    for sample, row in zip(readings.gpus, view.gpus, strict=True):
        g = dataclasses.asdict(sample)
        g.update(name=row.name, memory_pct=row.memory_pct, level=row.memory_level)
        gpus.append(g)
    samples = {p.pid: p for job in readings.jobs for p in job.processes}
    infos = {pid: info for job in readings.jobs for pid, info in job.info.items()}
    jobs = []
    for job in view.jobs:
        processes = []
        for row in job.rows:
            p = samples[row.pid]
            info = infos.get(row.pid)
            processes.append(
                {
                    "pid": p.pid,
                    "ppid": p.ppid,
                    "depth": row.depth,
                    "role": p.role,
                    "rank": p.rank,
                    "name": p.name,
                    "cmdline": info.cmdline if info else [],
                    "cpu_percent": p.cpu_percent,
                    "threads": p.threads,
                    "rss": p.rss,
                    "pss": p.pss,
                    "uss": p.uss,
                    "swap": p.swap,
                    "gpu_memory": p.gpu_memory,
                    "unavailable": dict(p.unavailable),
                }
            )
        jobs.append(
            {
                "root_pid": job.root_pid,
                "command": job.command,
                "ranks": job.ranks,
                "workers": job.workers,
                "cpu_percent": job.cpu_percent,
                "threads": job.threads,
                "rss": job.rss,
                "pss": job.pss,
                "gpu_memory": job.gpu_memory,
                "status": job.status,
                "status_level": job.status_level,
                "recording": (
                    dataclasses.asdict(job.recording) if job.recording is not None else None
                ),
                "processes": processes,
            }
        )
    return {
        "schema": SCHEMA,
        "t": readings.t,
        "hostname": readings.hostname,
        "interval_s": readings.interval_s,
        "thresholds": dataclasses.asdict(thresholds),
        "host": host,
        "gpu": {
            "available": status.available,
            "reason": status.reason,
            "driver_version": status.driver_version,
            "cuda_driver_version": status.cuda_driver_version,
            "pids_unresolved_reason": getattr(status, "process_pids_unresolved", None),
        },
        "gpus": gpus,
        "gpu_processes": [
            {
                "gpu_index": gp.gpu_index,
                "pid": gp.pid,
                "local_pid": gp.local_pid,
                "resolved": gp.local_pid is not None,
                "used_memory": gp.used_memory,
                "job": gp.job_root,
            }
            for gp in view.gpu_processes
        ],
        "jobs": jobs,
        "notes": list(readings.notes),
    }
