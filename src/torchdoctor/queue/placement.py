"""Where waiting jobs go: a pure function of the machine now, the jobs running, and the line.

Admission counts, per GPU, NVML's free memory minus what the queue has promised to its jobs
and they have not allocated yet (a job that is starting holds nothing yet, so its declared need
counts in full until NVML shows its processes' memory), minus a margin. Memory held by anyone
else - other users, other programs - is already off NVML's free figure: it counts as used.
CPU cores are handed out as disjoint sets; RAM is MemAvailable minus the same kind of promises.

Order, across users: round-robin. Each user's waiting jobs are in their own line (priority,
then first come first served: priorities order one user's jobs, never one user before
another); the next job to place is the one whose owner has the fewest jobs running or placed
before it; between owners with as many, the one whose last job started longest ago (never
first), then earlier submission. So one user's 20 queued jobs never starve
another's one. An admin's per-user limit (GPUs, cores at once) keeps a job waiting, without
holding anything back from others. A job that does not fit keeps what it would
take (in every resource where it fits) and freezes the rest of the resources it lacks, so a
job further down the line starts only on what the earlier ones could not use anyway: backfill
never delays a job ahead of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.queue.machine import GpuState, MachineState
from torchdoctor.queue.model import Job
from torchdoctor.units import fmt_bytes

MIB = 1024**2


def gpu_margin(total: int) -> int:
    """VRAM kept free on every GPU: CUDA contexts and allocator slack that no one declares."""
    return max(256 * MIB, total // 50)


def ram_margin(total: int) -> int:
    return max(512 * MIB, total // 50)


@dataclass(slots=True)
class Usage:
    """What a running job holds now, as measured: VRAM per GPU UUID, RSS of its processes."""

    vram: dict[str, int] = field(default_factory=dict)
    rss: int = 0


@dataclass(slots=True)
class Decision:
    job_id: int
    gpus: list[str] | None  # UUIDs; None: the job waits
    cpus: list[int] | None
    reason: str | None  # why it waits

    @property
    def start(self) -> bool:
        return self.cpus is not None


@dataclass(slots=True)
class _Pool:
    """Resources still free during one planning pass."""

    gpu_avail: dict[str, int]  # UUID -> VRAM that may still be promised
    gpu_jobs: dict[str, int]  # UUID -> queue jobs on it (running or placed in this pass)
    gpu_exclusive: set[str]  # held whole by a job
    gpu_frozen: set[str]
    cores: list[int]
    core_budget: int
    mem_avail: int
    cores_frozen: bool = False
    mem_frozen: bool = False
    busy: dict[int, float] = field(default_factory=dict)  # free CPUs kept busy by others
    user_cpus: Counter = field(default_factory=Counter)  # uid -> cores held or placed
    user_gpus: Counter = field(default_factory=Counter)


def order(
    jobs: list[Job], running: list[Job] = (), last_start: dict[Any, float] | None = None
) -> list[Job]:
    """The line: round-robin by user (fewest jobs running or ahead first, then the user whose
    last job started longest ago: ``last_start``, uid -> time), each user's own jobs by higher
    priority, then earlier submission."""
    ahead = Counter(job.uid for job in running)
    last = last_start or {}
    out = []
    for job in sorted(jobs, key=lambda j: (-j.priority, j.id)):
        out.append(((ahead[job.uid], last.get(job.uid) or 0.0, job.id), job))
        ahead[job.uid] += 1
    return [job for _key, job in sorted(out, key=lambda pair: pair[0])]


def plan(
    machine: MachineState,
    running: list[Job],
    usage: dict[int, Usage],
    waiting: list[Job],
    limits: Callable[[str | None], Any] | None = None,
    last_start: dict[Any, float] | None = None,
    busy_outside: float | None = None,
) -> list[Decision]:
    """One decision per waiting job (in line order): start where, or why it waits.
    ``limits(user)`` is the admin's limit for a user (``gpus``, ``cpus``; None: none).
    ``busy_outside``: a CPU no queue job holds that was at least this busy (0-1) is kept busy
    by processes the queue did not start, and is not promised (None: every free CPU is)."""
    pool = _pool(machine, running, usage, busy_outside)
    decisions = []
    for job in order(waiting, running, last_start):
        over = _over_limit(job, limits(job.user) if limits else None, pool)
        if over is not None:
            decisions.append(Decision(job.id, None, None, over))
            continue
        decision = _place(job, machine, pool)
        if decision.start:
            pool.user_cpus[job.uid] += job.cpus
            pool.user_gpus[job.uid] += job.gpus
        decisions.append(decision)
    return decisions


def _over_limit(job: Job, limit: Any, pool: _Pool) -> str | None:
    """Why the owner's limit keeps this job waiting, or None."""
    if limit is None:
        return None
    who = job.user or f"uid {job.uid}"
    for kind, asked, held, most in (
        ("core", job.cpus, pool.user_cpus[job.uid], limit.cpus),
        ("GPU", job.gpus, pool.user_gpus[job.uid], limit.gpus),
    ):
        if most is not None and asked and held + asked > most:
            return (
                f"waiting: {who} may use {most} {kind}(s) at once (the admin's limit); "
                f"{held} in use by their jobs"
            )
    return None


def _pool(
    machine: MachineState,
    running: list[Job],
    usage: dict[int, Usage],
    busy_outside: float | None = None,
) -> _Pool:
    avail = {g.uuid: g.free - gpu_margin(g.total) for g in machine.gpus}
    jobs_on = {g.uuid: 0 for g in machine.gpus}
    exclusive: set[str] = set()
    used_cores: set[int] = set()
    n_cores = 0
    mem = machine.mem_available - ram_margin(machine.mem_total)
    user_cpus: Counter = Counter()
    user_gpus: Counter = Counter()
    for job in running:
        held = usage.get(job.id, Usage())
        for uuid in job.assigned_gpus:
            if uuid not in avail:
                continue
            jobs_on[uuid] += 1
            if job.vram is None:
                exclusive.add(uuid)
            else:
                avail[uuid] -= max(0, job.vram - held.vram.get(uuid, 0))
        used_cores.update(job.assigned_cpus)
        n_cores += len(job.assigned_cpus)
        user_cpus[job.uid] += len(job.assigned_cpus)
        user_gpus[job.uid] += len(job.assigned_gpus)
        if job.mem is not None:
            mem -= max(0, job.mem - held.rss)
    busy = {}
    if busy_outside is not None:
        busy = {
            c: share
            for c, share in machine.cpu_busy.items()
            if share >= busy_outside and c not in used_cores and c in machine.cpus
        }
    return _Pool(
        gpu_avail=avail,
        gpu_jobs=jobs_on,
        gpu_exclusive=exclusive,
        gpu_frozen=set(),
        busy=busy,
        cores=[c for c in machine.cpus if c not in used_cores and c not in busy],
        core_budget=machine.max_cores - n_cores,
        mem_avail=mem,
        user_cpus=user_cpus,
        user_gpus=user_gpus,
    )


def _place(job: Job, machine: MachineState, pool: _Pool) -> Decision:
    gpus, gpu_reason = _choose_gpus(job, machine, pool)
    nodes = {g.numa_node for g in machine.gpus if gpus and g.uuid in gpus} - {None}
    cpus, cpu_reason = _choose_cpus(job, machine, pool, nodes)
    mem_ok = job.mem is None or (not pool.mem_frozen and job.mem <= pool.mem_avail)
    mem_reason = None
    if not mem_ok:
        mem_reason = (
            "RAM held for a job ahead in the line"
            if pool.mem_frozen
            else f"needs {fmt_bytes(job.mem)} of RAM, {fmt_bytes(max(0, pool.mem_avail))} available"
        )
    fits = gpus is not None and cpus is not None and mem_ok
    # Take what fits, freeze what does not: nothing behind this job may take it meanwhile.
    if gpus is not None:
        _take_gpus(job, gpus, pool)
    elif job.gpus:
        pool.gpu_frozen.update(_wanted_gpus(job, machine, pool))
    if cpus is not None:
        pool.cores = [c for c in pool.cores if c not in cpus]
        pool.core_budget -= len(cpus)
    else:
        pool.cores_frozen = True
    if job.mem is not None:
        if mem_ok:
            pool.mem_avail -= job.mem
        else:
            pool.mem_frozen = True
    if fits:
        return Decision(job.id, gpus, cpus, None)
    reasons = [r for r in (gpu_reason, cpu_reason, mem_reason) if r]
    return Decision(job.id, None, None, "waiting: " + "; ".join(reasons))


def _candidates(job: Job, machine: MachineState) -> list[GpuState]:
    if job.gpu_ids:
        return [g for uuid in job.gpu_ids if (g := machine.gpu(uuid)) is not None]
    return list(machine.gpus)


def _fits_gpu(job: Job, g: GpuState, pool: _Pool) -> bool:
    if g.uuid in pool.gpu_frozen or g.uuid in pool.gpu_exclusive:
        return False
    if job.vram is None:  # the whole GPU: no other queue job and no one else's process on it
        return pool.gpu_jobs[g.uuid] == 0 and not g.processes
    return job.vram <= pool.gpu_avail[g.uuid]


def _choose_gpus(
    job: Job, machine: MachineState, pool: _Pool
) -> tuple[list[str] | None, str | None]:
    if not job.gpus:
        return [], None
    candidates = _candidates(job, machine)
    fitting = [g for g in candidates if _fits_gpu(job, g, pool)]
    if job.gpu_ids:
        if len(fitting) == len(job.gpu_ids):
            return [g.uuid for g in fitting], None
    elif len(fitting) >= job.gpus:
        # Most room first (spreads the load; the rest stays free for bigger jobs).
        fitting.sort(key=lambda g: (-pool.gpu_avail[g.uuid], g.index))
        return [g.uuid for g in fitting[: job.gpus]], None
    return None, _gpu_reason(job, candidates, pool)


def _gpu_reason(job: Job, candidates: list[GpuState], pool: _Pool) -> str:
    want = "whole (unshared)" if job.vram is None else f"with {fmt_bytes(job.vram)} free"
    parts = []
    for g in candidates:
        if g.uuid in pool.gpu_frozen:
            state = "held for a job ahead in the line"
        elif g.uuid in pool.gpu_exclusive:
            state = "held whole by a queue job"
        elif job.vram is None:
            others = len(g.processes)
            state = f"{pool.gpu_jobs[g.uuid]} queue job(s), {others} process(es) on it"
        else:
            state = f"{fmt_bytes(max(0, pool.gpu_avail[g.uuid]))} available"
        parts.append(f"GPU {g.index} {state}")
    return f"needs {job.gpus} GPU(s) {want}; " + ", ".join(parts)


def _wanted_gpus(job: Job, machine: MachineState, pool: _Pool) -> list[str]:
    """The GPUs a waiting job will most likely get: held back from jobs behind it."""
    candidates = _candidates(job, machine)
    if job.gpu_ids:
        return [g.uuid for g in candidates]
    candidates.sort(key=lambda g: (-(g.total - _foreign(g)), g.index))
    return [g.uuid for g in candidates[: job.gpus]]


def _foreign(g: GpuState) -> int:
    return sum(g.processes.values())


def _take_gpus(job: Job, gpus: list[str], pool: _Pool) -> None:
    for uuid in gpus:
        pool.gpu_jobs[uuid] += 1
        if job.vram is None:
            pool.gpu_exclusive.add(uuid)
        else:
            pool.gpu_avail[uuid] -= job.vram


def _choose_cpus(
    job: Job, machine: MachineState, pool: _Pool, nodes: set[int]
) -> tuple[list[int] | None, str | None]:
    if pool.cores_frozen:
        return None, "cores held for a job ahead in the line"
    n = job.cpus
    if n > len(pool.cores) or n > pool.core_budget:
        free = max(0, min(len(pool.cores), pool.core_budget))
        why = f"needs {n} core(s), {free} free"
        if pool.busy:
            shares = ", ".join(
                f"{c} ({share * 100:.0f} %)" for c, share in sorted(pool.busy.items())
            )
            why += f" (CPU {shares} busy with processes outside the queue)"
        return None, why
    by_node: dict[int, list[int]] = {}
    for c in pool.cores:
        by_node.setdefault(machine.cpu_node.get(c, 0), []).append(c)
    # One NUMA node if any can hold the job: the GPUs' node first, then the fullest that fits
    # (keeps whole nodes free for big jobs); otherwise the GPUs' nodes first, then the rest.
    fitting = [node for node, cores in by_node.items() if len(cores) >= n]
    if fitting:
        best = min(fitting, key=lambda node: (node not in nodes, len(by_node[node]), node))
        return sorted(by_node[best])[:n], None
    ordered = sorted(by_node, key=lambda node: (node not in nodes, node))
    picked = [c for node in ordered for c in sorted(by_node[node])]
    return picked[:n], None
