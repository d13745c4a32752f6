"""The sampler's join of NVML's per-process memory onto the job: zero only when measured."""

from __future__ import annotations

import os

try:
    from gpu_fixtures import HOST_PIDS, fake_nvml
except ImportError:  # tests/sampling imported as a package
    from .gpu_fixtures import HOST_PIDS, fake_nvml

from torchdoctor.sampling.gpus import GpuReader
from torchdoctor.sampling.job import JobReader
from torchdoctor.sampling.pidns import PidNamespace
from torchdoctor.sampling.sampler import Sampler

GIB = 1 << 30


def _snapshot(fake, pid_namespace=HOST_PIDS):
    job = JobReader(os.getpid())
    gpus = GpuReader(fake, pid_namespace=pid_namespace)
    try:
        return Sampler(None, job, gpus).snapshot()
    finally:
        job.close()
        gpus.close()


def test_a_job_process_on_no_gpu_list_holds_a_measured_zero():
    fake = fake_nvml.scenario("two_gpus")
    snap = _snapshot(fake)
    me = next(p for p in snap.processes if p.pid == os.getpid())
    assert me.gpu_memory == 0 and "gpu_memory" not in me.unavailable


def test_a_lost_gpu_makes_job_gpu_memory_unknown_not_zero():
    fake = fake_nvml.scenario("gpu_lost_mid_run", lost_after_calls=0)
    fake.gpus[0].compute_processes = [(os.getpid(), 2 * GIB)]
    snap = _snapshot(fake)
    me = next(p for p in snap.processes if p.pid == os.getpid())
    assert me.gpu_memory is None
    assert me.unavailable["gpu_memory"] == "process list unavailable on GPU 1"


def test_unresolvable_pids_make_job_gpu_memory_unknown():
    fake = fake_nvml.scenario("two_gpus")
    container = PidNamespace(procfs_is_host=False)
    snap = _snapshot(fake, pid_namespace=container)
    me = next(p for p in snap.processes if p.pid == os.getpid())
    assert me.gpu_memory is None
    assert me.unavailable["gpu_memory"] == container.unresolved_reason
