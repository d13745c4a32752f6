"""One snapshot of host, job and GPUs, with the job's GPU memory joined per process."""

from __future__ import annotations

import time

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

    def snapshot(self) -> Snapshot:
        t = time.time()
        host = self.host.read() if self.host is not None else None
        processes, new, ended = self.job.read() if self.job is not None else ([], [], [])
        gpu_samples, gpu_procs = [], []
        if self.gpus is not None:
            gpu_samples, gpu_procs = self.gpus.read({p.pid for p in processes})
        if self.gpus is not None and self.gpus.status.available and gpu_samples:
            # NVML lists every compute/graphics process per device, so a job process that
            # is absent holds no GPU memory: a measured zero, not an unknown.
            by_pid: dict[int, int] = {}
            for gp in gpu_procs:
                if gp.in_job and gp.local_pid is not None and gp.used_memory is not None:
                    by_pid[gp.local_pid] = by_pid.get(gp.local_pid, 0) + gp.used_memory
            for p in processes:
                p.gpu_memory = by_pid.get(p.pid, 0)
        return Snapshot(
            t=t,
            host=host,
            processes=processes,
            gpus=gpu_samples,
            gpu_processes=gpu_procs,
            new_processes=new,
            ended_pids=ended,
        )
