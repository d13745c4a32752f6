"""The host: shared memory, file descriptors, NUMA placement and CPU oversubscription.

Thresholds:

- /dev/shm: DataLoader workers hand every batch to the trainer through it, and NCCL puts its
  intra-node buffers there. Below 512 MiB is a warning (as DeepSpeed's ds_report says); at
  Docker's 64 MiB default it is an error when workers are used ("bus error", "No space left on
  device" in ``posix_fallocate``).
- open files: workers pass tensors as file descriptors; 1024 (a common soft limit) runs out
  with a few workers and large batches ("Too many open files").
- CPU oversubscription: ranks x (threads + workers) above the CPUs this process may use.
- rank count: more ranks than the node can hold at all, an error (a launch refuses it unless
  --force): without GPUs, more than RANKS_PER_CPU ranks per usable CPU (each would get under a
  quarter of a CPU: the job crawls while the ranks' memory fills the machine); with or without
  them, more ranks than RAM holds at RANK_MEMORY each. More ranks than GPUs is gpus.visible's.
"""

from __future__ import annotations

import os
import resource

from torchdoctor.doctor.check import ERROR, OK, SKIPPED, WARNING, Check
from torchdoctor.doctor.facts import Facts
from torchdoctor.sampling import procfs
from torchdoctor.units import fmt_bytes, fmt_cpu_list, parse_cpu_list

MIB = 1024**2
SHM_WARN = 512 * MIB
SHM_DOCKER_DEFAULT = 64 * MIB
OPEN_FILES_MINIMUM = 4096
OPEN_FILES_ADVISED = 65536


def check_shm(facts: Facts, path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return Check(
            "host.shm",
            ERROR,
            f"{path} is missing or unreadable ({exc.strerror}): DataLoader workers and NCCL "
            "need it",
            "mount a tmpfs there (Docker: --shm-size=1g or --ipc=host)",
        )
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    workers = facts.plan.workers
    saw = f"{path}: {fmt_bytes(size)} ({fmt_bytes(free)} free)"
    details = {"size": size, "free": free}
    fix = "give it 1 GiB or more: Docker --shm-size=1g (or --ipc=host); on a host `mount -o remount,size=1G /dev/shm`"
    if size <= SHM_DOCKER_DEFAULT and workers != 0:
        return Check(
            "host.shm",
            ERROR,
            saw + ": at or below Docker's 64 MiB default, too small for DataLoader workers "
            "(bus errors, 'No space left on device') and NCCL's shared buffers",
            fix,
            details,
        )
    if size < SHM_WARN:
        return Check("host.shm", WARNING, saw + ": below 512 MiB", fix, details)
    return Check("host.shm", OK, saw, details=details)


def check_open_files(facts: Facts) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def text(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else str(v)

    saw = f"open-files limit {text(soft)} (hard {text(hard)})"
    details = {"soft": soft, "hard": hard}
    if soft != resource.RLIM_INFINITY and soft < OPEN_FILES_MINIMUM:
        target = (
            OPEN_FILES_ADVISED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_ADVISED)
        )
        if target >= OPEN_FILES_MINIMUM:
            fix = f"`ulimit -n {target}` before starting the run"
        else:
            fix = (
                f"the hard limit is {text(hard)}: raise it in /etc/security/limits.conf "
                f"(Docker: --ulimit nofile={OPEN_FILES_ADVISED}:{OPEN_FILES_ADVISED})"
            )
        return Check(
            "host.open_files",
            WARNING,
            saw + ": DataLoader workers may fail with 'Too many open files'",
            fix,
            details,
        )
    return Check("host.open_files", OK, saw, details=details)


def cpu_list_text(cpus: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``; "none" for no CPU."""
    return fmt_cpu_list(cpus) if cpus else "none"


def numa_nodes(base: str = "/sys/devices/system/node") -> dict[int, list[int]]:
    nodes: dict[int, list[int]] = {}
    try:
        names = os.listdir(base)
    except OSError:
        return nodes
    for name in names:
        if name.startswith("node") and name[4:].isdigit():
            text = procfs.read_text(f"{base}/{name}/cpulist")
            if text is not None:
                nodes[int(name[4:])] = parse_cpu_list(text)
    return dict(sorted(nodes.items()))


def check_numa(facts: Facts) -> Check:
    nodes = numa_nodes()
    if not nodes:
        return Check(
            "host.numa", SKIPPED, "/sys/devices/system/node not readable: NUMA layout unknown"
        )
    layout = "; ".join(f"node {n}: CPUs {cpu_list_text(c)}" for n, c in nodes.items())
    saw = f"{len(nodes)} NUMA node(s): {layout}"
    details: dict = {"nodes": {str(n): c for n, c in nodes.items()}}
    near = []
    if facts.gpu_status.available and facts.topology.available:
        for p in facts.topology.placements:
            where = f"node {p.numa_node}" if p.numa_node is not None else "node ?"
            cpus = cpu_list_text(p.cpus) if p.cpus else "?"
            near.append(f"GPU{p.index}: {where}, CPUs {cpus}")
        details["gpus"] = {
            str(p.index): {"numa_node": p.numa_node, "cpus": p.cpus}
            for p in facts.topology.placements
        }
        saw += "; " + "; ".join(near)
    if len(nodes) > 1 and near:
        allowed = set(os.sched_getaffinity(0))
        far = [p.index for p in facts.topology.placements if p.cpus and not allowed & set(p.cpus)]
        if far:
            return Check(
                "host.numa",
                WARNING,
                saw + f"; this process may not run on any CPU near GPU(s) {far}",
                "bind each rank near its GPU: torchrun --numa-binding=node",
                details,
            )
        return Check(
            "host.numa",
            OK,
            saw,
            "to keep each rank's memory near its GPU, start with torchrun --numa-binding=node",
            details,
        )
    return Check("host.numa", OK, saw, details=details)


def check_oversubscription(facts: Facts) -> Check:
    plan = facts.plan
    from torchdoctor.sampling.hostinfo import whole_cpus_here

    cpus = whole_cpus_here()
    nproc = plan.nproc_per_node
    if nproc is None:
        gpus = facts.gpu_status.gpus if facts.gpu_status.available else []
        nproc = len(gpus) or 1
        how = f"{nproc} rank(s) per node ({'one per GPU' if gpus else 'no GPU; --nproc-per-node plans more'})"
    else:
        how = f"{nproc} rank(s) per node"
    omp = plan.env.get("OMP_NUM_THREADS")
    if omp and omp.isdigit():
        threads, source = int(omp), f"OMP_NUM_THREADS={omp}"
    elif nproc > 1:
        threads, source = 1, "torchrun sets OMP_NUM_THREADS=1 when it is unset"
    else:
        threads, source = cpus, "torch's default: one thread per CPU"
    workers = plan.workers or 0
    total = nproc * (threads + workers)
    saw = (
        f"{how} x ({threads} thread(s) [{source}]"
        + (f" + {workers} DataLoader worker(s)" if workers else "")
        + f") = {total} busy threads on {cpus} usable CPU(s)"
    )
    details = {"nproc": nproc, "threads": threads, "workers": workers, "cpus": cpus}
    if total > cpus:
        return Check(
            "host.cpu_oversubscription",
            WARNING,
            saw + ": oversubscribed",
            _oversubscription_fix(nproc, threads, workers, cpus),
            details,
        )
    return Check("host.cpu_oversubscription", OK, saw, details=details)


def _oversubscription_fix(nproc: int, threads: int, workers: int, cpus: int) -> str | None:
    """What brings ranks x (threads + workers) down to the CPUs: fewer ranks when the ranks
    alone outnumber the CPUs (no thread setting helps then), else fewer threads (only where
    that is a change) and fewer DataLoader workers."""
    if nproc > cpus:
        return f"start at most {cpus} rank(s) per node (--nproc-per-node {cpus})"
    per_rank = cpus // nproc
    fixes = []
    wanted = max(1, per_rank - workers) if workers < per_rank else 1
    if wanted < threads:
        fixes.append(f"export OMP_NUM_THREADS={wanted}")
    if workers and nproc * (1 + workers) > cpus:
        fixes.append(f"use at most {max(0, per_rank - 1)} DataLoader worker(s) per rank")
    return " and ".join(fixes) or None


# Without GPUs, ranks per usable CPU past which a launch is refused: each rank would get under
# a quarter of a CPU (the cpu_oversubscription warning covers the ranks between 1x and this).
RANKS_PER_CPU = 4
# RAM a rank holds of its own at the least: a CPU rank that imported torch, joined a gloo
# group and ran a step held 145 MiB of private memory (torch 2.13), before any data or model.
RANK_MEMORY = 150 * MIB


def check_rank_count(facts: Facts) -> Check:
    from torchdoctor.sampling.hostinfo import available_ram, whole_cpus_here

    gpus = facts.gpu_status.gpus if facts.gpu_status.available else []
    nproc = facts.plan.nproc_per_node or len(gpus) or 1  # none planned: one per GPU, or one
    cpus = whole_cpus_here()
    ram = available_ram()
    details = {"nproc": nproc, "cpus": cpus, "gpus": len(gpus), "available_ram": ram}
    holds = max(1, ram // RANK_MEMORY)  # ranks the RAM available holds
    fits = min(cpus, holds)  # what the fix offers without GPUs: a rank per CPU, if RAM holds it
    if not gpus and nproc > RANKS_PER_CPU * cpus:
        return Check(
            "host.rank_count",
            ERROR,
            f"{nproc} ranks per node on {cpus} usable CPU(s) and no GPU: more than "
            f"{RANKS_PER_CPU} per CPU",
            f"start at most {fits} rank(s) per node (--nproc-per-node {fits})",
            details,
        )
    if nproc > holds:
        return Check(
            "host.rank_count",
            ERROR,
            f"{nproc} ranks per node need at least {fmt_bytes(nproc * RANK_MEMORY)} of RAM "
            f"({fmt_bytes(RANK_MEMORY)} each before any data), {fmt_bytes(ram)} is available",
            f"start at most {holds} rank(s) per node (--nproc-per-node {holds})",
            details,
        )
    return Check(
        "host.rank_count",
        OK,
        f"{nproc} rank(s) per node: {cpus} usable CPU(s), {fmt_bytes(ram)} of RAM available",
        details=details,
    )


CHECKS = (check_shm, check_open_files, check_numa, check_oversubscription, check_rank_count)
