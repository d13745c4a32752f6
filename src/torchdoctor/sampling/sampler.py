"""One snapshot of host, job and GPUs, with the job's GPU memory joined per process."""

from __future__ import annotations

import time

from torchdoctor.sampling.gpus import LOST_REASON
from torchdoctor.sampling.types import Snapshot


class Sampler:
    """Reads every source once per call; the readers keep their own slow tiers.

    ``host``, ``job`` and ``gpus`` are reader objects (HostReader, JobReader, GpuReader) or
    ``None`` to leave a source out.
    """

    def __init__(self, host, job, gpus) -> None:
        self.host = host
        self.job = job
        self.gpus = gpus

    def close(self) -> None:
        """Release the descriptors the host and job readers keep. The GPU reader is the
        caller's: NVML start-up is costly, so one reader serves many recordings."""
        for reader in (self.host, self.job):
            if reader is not None:
                reader.close()

    def snapshot(self) -> Snapshot:
        t = time.time()
        host = self.host.read() if self.host is not None else None
        processes, new, ended = self.job.read() if self.job is not None else ([], [], [])
        gpu_samples, gpu_procs = [], []
        if self.gpus is not None:
            gpu_samples, gpu_procs = self.gpus.read({p.pid for p in processes})
        if self.gpus is not None and self.gpus.status.available and gpu_samples:
            _join_gpu_memory(processes, gpu_samples, gpu_procs, self.gpus.status)
        return Snapshot(
            t=t,
            host=host,
            processes=processes,
            gpus=gpu_samples,
            gpu_processes=gpu_procs,
            new_processes=new,
            ended_pids=ended,
        )


def _join_gpu_memory(processes, gpu_samples, gpu_procs, status) -> None:
    """Each job process's GPU memory summed over devices, or None with the reason.

    NVML lists every process per device, so a job process absent from every complete list
    holds no GPU memory: a measured zero. When a list is missing (a lost GPU, an NVML error)
    or NVML's PIDs cannot be matched to ours (a container), absence proves nothing.
    """
    unknown_reason = status.process_pids_unresolved
    if unknown_reason is None:
        missing = [
            g.index
            for g in gpu_samples
            if "processes" in g.unavailable or g.unavailable.get("memory_used") == LOST_REASON
        ]
        if missing:
            unknown_reason = f"process list unavailable on GPU {', '.join(map(str, missing))}"
    by_pid: dict[int, int] = {}
    no_figure: set[int] = set()
    for gp in gpu_procs:
        if not gp.in_job or gp.local_pid is None:
            continue
        if gp.used_memory is None:
            no_figure.add(gp.local_pid)
        else:
            by_pid[gp.local_pid] = by_pid.get(gp.local_pid, 0) + gp.used_memory
    for p in processes:
        if unknown_reason is not None:
            p.gpu_memory = None
            p.unavailable["gpu_memory"] = unknown_reason
        elif p.pid in no_figure:
            p.gpu_memory = None
            p.unavailable["gpu_memory"] = "NVML gives no memory figure for this process"
        else:
            p.gpu_memory = by_pid.get(p.pid, 0)
