"""The environment a queued job starts with: the one captured at submit, plus its placement."""

from __future__ import annotations

import os
import socket

from torchdoctor.queue.model import Job

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
JOB_ID_VAR = "TORCHDOCTOR_QUEUE_JOB"
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


def is_torchrun(argv: list[str]) -> bool:
    """Whether the command is torchrun (or ``python -m torch.distributed.run``)."""
    if not argv:
        return False
    if os.path.basename(argv[0]) == "torchrun":
        return True
    return any(a == "-m" and b in _LAUNCHERS for a, b in zip(argv, argv[1:], strict=False))


def processes_per_node(argv: list[str]) -> int:
    """torchrun's ``--nproc-per-node N`` (1 when not given or not a number)."""
    for i, arg in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            value = None
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            if value is not None and value.isdigit():
                return max(1, int(value))
    return 1


def job_environment(job: Job) -> dict[str, str]:
    """GPUs by UUID in PCI order (empty: no GPU at all), one thread per core given, and for
    torchrun a rendezvous port of its own so two jobs never meet on 29500."""
    env = dict(job.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(job.assigned_gpus)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    ranks = processes_per_node(job.argv) if is_torchrun(job.argv) else 1
    threads = str(max(1, len(job.assigned_cpus) // ranks))
    for name in THREAD_VARS:
        env[name] = threads
    if job.master_port is not None:
        env["MASTER_PORT"] = str(job.master_port)
        if is_torchrun(job.argv):
            env["PET_MASTER_PORT"] = str(job.master_port)  # torchrun's --master-port
    env[JOB_ID_VAR] = str(job.id)
    return env


def free_port(taken: set[int]) -> int:
    """A TCP port free on 127.0.0.1 now and not handed to another running job."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port
