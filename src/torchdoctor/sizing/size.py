"""From a recorded run to what one node must give the job, each figure with its source.

One definition for every hand-off target (Slurm, Ray, Kubernetes): the target only renders it.

Sizes are per node: one task per node runs torchrun, which starts ``ranks_per_node`` ranks.
When the recording ran another number of ranks than a node will, the per-node figures are the
recording's per-rank figures times the ranks per node, and the notes say so: they are
extrapolated, not measured at that size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torchdoctor.errors import UserError
from torchdoctor.sizing.command import job_identity
from torchdoctor.sizing.figure import Figure
from torchdoctor.sizing.network import recorded_network_env
from torchdoctor.sizing.recorded import RecordedJob
from torchdoctor.units import fmt_bytes, fmt_duration, fmt_mem_option

MIB = 1024 * 1024
# The longest time limit torchdoctor writes. Slurm keeps limits in minutes in 32 bits (INFINITE
# is 0xffffffff minutes) and a partition's MaxTime caps them far below: a year is past any real
# cluster's limit, and a figure past it is a mistake (a mistyped --steps), not a job.
MAX_TIME_LIMIT_S = 365 * 86400


def format_memory(n_bytes: int) -> str:
    """Whole MiB as ``"1280M"``, whole GiB as ``"64G"``: the notation of every figure's source
    line (sbatch's ``--mem`` reads it as it is)."""
    return fmt_mem_option(n_bytes, slurm=True)


# Margins over what was measured. Memory: a peak sampled every second can miss a shorter one,
# and a node's page cache and Slurm's own step daemon count against --mem as well.
MEM_MARGIN = 0.25
MEM_MARGIN_MIN = 512 * MIB
MEM_ROUND = 256 * MIB
# What runs on a node besides the recorded job. Measured on this project's test machine with
# torch 2.13 (CPU): torchrun's agent, a Python process with torch imported, peaked at 186 MiB
# PSS; `torchdoctor run` itself at 24 MiB. The agent is added only where the recording did not
# already hold one; the recorder never records itself.
TORCHRUN_AGENT_MEM = 192 * MIB
RECORDER_MEM = 32 * MIB
# Time: steps vary between nodes and runs, and a job killed at its limit loses its last
# checkpoint interval; a generous limit costs little in the queue.
TIME_MARGIN = 0.5
TIME_MARGIN_MIN_S = 300.0
# Shared memory (/dev/shm): DataLoader workers hand batches to their rank through it, and a
# container's default is 64 MB (pytorch #108861: bus errors). The floor is doctor's own fix for
# a small /dev/shm (1 GiB); over a measured peak, x2: the batches in flight grow with
# prefetch_factor and a sampled peak can miss a shorter one.
SHM_FLOOR = 1024 * MIB
SHM_FACTOR = 2.0
SHM_ROUND = 256 * MIB
# A job whose peak CPU use reaches this share of what it could use was limited by the machine.
CPU_LIMITED_SHARE = 0.9


@dataclass(slots=True)
class JobRequest:
    """What the user asked on the command line; None: size it from the recording."""

    command: list[str]
    nodes: int = 1
    gpus_per_node: int | None = None
    ranks_per_node: int | None = None
    time_limit_s: int | None = None  # None: --time auto
    steps: int | None = None
    gpu_type: str | None = None
    network_env: dict[str, Figure] = field(default_factory=dict)  # e.g. from doctor's advice
    node_cpus: int | None = None  # CPUs of the cluster's largest node (sinfo), when known


@dataclass(slots=True)
class JobSize:
    """The per-node request and the job's shape, as the script writes them."""

    nodes: int
    ranks_per_node: Figure  # int
    gpus_per_node: Figure  # int, 0 = no GPU
    cpus_per_task: Figure  # int: the node's one task holds every rank's CPUs
    threads_per_rank: Figure  # int, OMP_NUM_THREADS
    mem_per_node: Figure | None  # bytes; None: the recording has no memory figure
    time_limit_s: Figure  # int seconds
    gpu_memory_per_gpu: Figure | None = None  # bytes the job needs on each GPU
    # bytes of /dev/shm a node needs; a Kubernetes memory-backed volume counts against the
    # memory limit, so manifests add it to mem_per_node (kuberay #3897)
    shm: Figure | None = None
    memory_peak: int | None = None  # bytes: the recorded peak for this node's ranks, no margin
    gpu_type: str | None = None
    network_env: dict[str, Figure] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # said on stderr and in the script


def size_job(job: RecordedJob, request: JobRequest) -> JobSize:
    """Size ``request`` from the recorded run ``job``."""
    if request.nodes < 1:
        raise UserError(f"--nodes {request.nodes}: a job needs at least one node")
    notes: list[str] = []
    if job.damage:
        # The reader's first line says how much is there ("the file holds N of its M bytes").
        how = re.search(r"\((.*?)\)", job.damage[0])
        notes.append(
            f"the recording {job.path} is damaged ({how.group(1) if how else 'cut short'}): "
            "the sizes come from the part that could be read; record the job again to size it "
            "from a whole run"
        )
    _check_command(job, request.command, notes)
    gpus = _gpus_per_node(job, request)
    ranks = _ranks_per_node(job, request, gpus.value)
    scale = ranks.value / job.ranks
    if scale != 1 or request.nodes > 1:
        notes.append(
            f"the recording ran {_n(job.ranks, 'rank')} on one machine; this job runs "
            f"{_n(ranks.value, 'rank')} on each of {_n(request.nodes, 'node')}: per-node sizes "
            "are the recording's per-rank figures x ranks per node, not measured at this size"
        )
    cpus, threads = _cpus(job, ranks.value, notes)
    if request.node_cpus and cpus.value > request.node_cpus:
        # More CPUs per task than any node has: Slurm would keep the job pending for ever.
        notes.append(
            f"the recording asks {cpus.value} CPUs per node but the largest node has "
            f"{request.node_cpus}: asked {request.node_cpus}; the DataLoader workers and torch "
            "threads then share them"
        )
        cpus = Figure(
            request.node_cpus, f"{cpus.source}; capped at the largest node's CPUs (sinfo)"
        )
        threads = Figure(
            min(threads.value, max(1, request.node_cpus // ranks.value)),
            f"{threads.source}, within the node's {request.node_cpus} CPUs",
        )
    mem = _memory(job, ranks.value)
    shm = _shm(job, ranks.value)
    time_limit = _time_limit(job, request, notes)
    return JobSize(
        nodes=request.nodes,
        ranks_per_node=ranks,
        gpus_per_node=gpus,
        cpus_per_task=cpus,
        threads_per_rank=threads,
        mem_per_node=mem,
        time_limit_s=time_limit,
        gpu_memory_per_gpu=_gpu_memory(job) if gpus.value else None,
        shm=shm,
        memory_peak=_memory_peak(job, ranks.value),
        gpu_type=request.gpu_type,
        network_env={**recorded_network_env(job.network_env), **request.network_env},
        notes=notes,
    )


def _check_command(job: RecordedJob, command: list[str], notes: list[str]) -> None:
    recorded, asked = job_identity(job.command), job_identity(command)
    if recorded != asked:
        notes.append(
            f"the recording is of `{recorded or ' '.join(job.command)}`, not of `{asked}`: "
            "its figures may not fit this job (record this command with `torchdoctor run`)"
        )


def _gpus_per_node(job: RecordedJob, request: JobRequest) -> Figure:
    if request.gpus_per_node is not None:
        if request.gpus_per_node < 0:
            raise UserError(f"--gpus-per-node {request.gpus_per_node}: give 0 or more")
        return Figure(request.gpus_per_node, "asked with --gpus-per-node")
    if job.gpus_used:
        return Figure(job.gpus_used, "GPUs holding the job's memory in the recording")
    return Figure(0, "the recorded run used no GPU")


def _ranks_per_node(job: RecordedJob, request: JobRequest, gpus: int) -> Figure:
    if request.ranks_per_node is not None:
        if request.ranks_per_node < 1:
            raise UserError(f"--ranks-per-node {request.ranks_per_node}: give 1 or more")
        return Figure(request.ranks_per_node, "asked with --ranks-per-node")
    if gpus:
        return Figure(gpus, "one rank per GPU")
    return Figure(job.ranks, "ranks that stepped in the recording")


def _cpus(job: RecordedJob, ranks: int, notes: list[str]) -> tuple[Figure, Figure]:
    per_rank_used = (job.cores_peak or 0.0) / job.ranks
    # A peak of 1.98 cores is two cores' worth of work; 2.3 needs a third.
    used = max(1, math.ceil(per_rank_used - 0.05))
    workers = max(job.num_workers or 0, job.advised_workers or 0)
    per_rank = max(used, 1 + workers)
    parts = [
        f"peak CPU use {per_rank_used:.2f} cores per rank"
        if job.cores_peak is not None
        else "no CPU figure in the recording"
    ]
    if workers:
        source = (
            "advised by diagnose"
            if (job.advised_workers or 0) > (job.num_workers or 0)
            else "as the job ran"
        )
        parts.append(f"1 + {workers} DataLoader workers per rank ({source})")
    if job.contended:
        # What the job got is not what it needs: count the threads it ran instead.
        threads = min(job.torch_threads or 1, math.ceil(job.usable_cpus or 1))
        per_rank = max(per_rank, threads + workers)
        parts.append(f"{threads} torch threads + workers, as it ran")
        notes.append(
            "other programs took the recorded run's CPUs (diagnose: cpu-contention): its CPU use "
            "understates what it needs and its steps are slower than on CPUs of its own; CPUs "
            "are sized from the threads it ran, and the time limit errs long"
        )
    elif (
        job.cores_peak is not None
        and job.usable_cpus
        and job.cores_peak >= CPU_LIMITED_SHARE * job.usable_cpus
    ):
        notes.append(
            f"the recorded run used all {job.usable_cpus:g} CPUs it had: on a larger node it may "
            "use more; measure there with `torchdoctor tune`"
        )
    cpus = Figure(
        per_rank * ranks,
        f"{' / '.join(parts)} -> {per_rank} per rank x {_n(ranks, 'rank')}",
    )
    threads_figure = Figure(
        max(1, per_rank - workers),
        f"the rank's {per_rank} CPUs less its {workers} DataLoader workers"
        if workers
        else "the rank's CPUs",
    )
    return cpus, threads_figure


def _memory(job: RecordedJob, ranks: int) -> Figure | None:
    peak, what = job.pss_peak, "peak PSS"
    if peak is None:
        peak, what = job.rss_peak, "peak RSS (no PSS figure in the recording)"
    if peak is None:
        return None
    jobs_share = peak / job.ranks * ranks
    extra = RECORDER_MEM + (0 if job.launcher_recorded else TORCHRUN_AGENT_MEM)
    need = jobs_share + extra
    margin = max(MEM_MARGIN * need, MEM_MARGIN_MIN)
    value = math.ceil((need + margin) / MEM_ROUND) * MEM_ROUND
    per = (
        f"{fmt_bytes(peak)} for {_n(job.ranks, 'rank')} -> {fmt_bytes(jobs_share)} for "
        f"{_n(ranks, 'rank')}"
        if ranks != job.ranks
        else fmt_bytes(peak)
    )
    added = "the recorder" if job.launcher_recorded else "torchrun's agent and the recorder"
    return Figure(
        value,
        f"{what} of the whole job {per}, + {fmt_bytes(extra)} for {added}, "
        f"+{MEM_MARGIN * 100:.0f} % (at least +{fmt_bytes(MEM_MARGIN_MIN)}) -> "
        f"{format_memory(value)}",
    )


def _memory_peak(job: RecordedJob, ranks: int) -> int | None:
    peak = job.pss_peak if job.pss_peak is not None else job.rss_peak
    return None if peak is None else int(peak / job.ranks * ranks)


def _shm(job: RecordedJob, ranks: int) -> Figure:
    if job.shm_peak is None:
        return Figure(
            SHM_FLOOR,
            "shared memory not measured (the recording predates its sampling): "
            f"{format_memory(SHM_FLOOR)}, doctor's fix for a small /dev/shm",
        )
    need = job.shm_peak / job.ranks * ranks
    value = max(SHM_FLOOR, math.ceil(need * SHM_FACTOR / SHM_ROUND) * SHM_ROUND)
    per = (
        f"{fmt_bytes(job.shm_peak)} for {_n(job.ranks, 'rank')} -> {fmt_bytes(need)} for "
        f"{_n(ranks, 'rank')}"
        if ranks != job.ranks
        else fmt_bytes(job.shm_peak)
    )
    return Figure(
        value,
        f"peak shared memory of the whole job {per} (RssShmem and /dev/shm files it held), "
        f"x{SHM_FACTOR:g}, at least {format_memory(SHM_FLOOR)} -> {format_memory(value)}",
    )


def _time_limit(job: RecordedJob, request: JobRequest, notes: list[str]) -> Figure:
    steps = request.steps or job.step_count
    estimate = None
    # Refused before any figure is computed: --steps 99999999999999999999 wrote
    # `--time=481633480341880:20:00`, which no cluster accepts (a count past 2^64 is refused as
    # such: past ~10^308 an int times a float raises OverflowError).
    too_long = (
        job.step_s is not None
        and steps is not None
        and (steps >= 2**64 or steps * job.step_s > MAX_TIME_LIMIT_S)
    )
    if too_long and request.time_limit_s is None:
        said = f"--steps {steps}" if request.steps is not None else "the recorded steps"
        raise UserError(
            f"{said} at {fmt_duration(job.step_s)} a step run longer than 365 days, more than "
            "any Slurm partition grants; give the steps the job runs, or --time"
        )
    if job.step_s is not None and steps and not too_long:
        estimate = (job.overhead_s or 0.0) + steps * job.step_s
        basis = (
            f"{steps} steps x {fmt_duration(job.step_s)} per step + "
            f"{fmt_duration(job.overhead_s or 0.0)} start-up = {fmt_duration(estimate)}"
        )
        if request.nodes > 1:
            notes.append(
                "step time was measured on one machine; across nodes each step also waits for "
                "the network (measure with `torchdoctor bench scaling`)"
            )
    elif request.steps is not None and job.step_s is None:
        raise UserError(
            "--steps needs the recording's step times, and it has none: record the job with "
            "instrumentation on (`torchdoctor run` without --no-instrument), or give --time"
        )
    elif job.duration_s is not None and not too_long:
        estimate = job.duration_s
        basis = f"wall time of the recorded run {fmt_duration(estimate)} (no step figures)"
    if request.time_limit_s is not None:
        said = f"; the recording suggests {basis}" if estimate is not None else ""
        return Figure(request.time_limit_s, f"asked with --time{said}")
    if estimate is None:
        raise UserError("the recording has no duration to size --time from: give --time HH:MM:SS")
    limit = estimate + max(TIME_MARGIN * estimate, TIME_MARGIN_MIN_S)
    if limit > MAX_TIME_LIMIT_S:  # a long run whose margin passes the year
        raise UserError(
            f"the time limit would be {fmt_duration(limit)} ({basis} plus margin), longer than "
            "365 days, more than any Slurm partition grants; give the steps the job runs, or --time"
        )
    limit = math.ceil(limit / 60) * 60
    return Figure(
        limit,
        f"{basis}, +{TIME_MARGIN * 100:.0f} % (at least +{fmt_duration(TIME_MARGIN_MIN_S)})",
    )


def _gpu_memory(job: RecordedJob) -> Figure | None:
    if job.gpu_memory_peak is None:
        return Figure(None, "the recorded run used no GPU: its GPU memory need is unknown")
    on = f" of a {job.gpu_name}" if job.gpu_name else ""
    total = f" ({fmt_bytes(job.gpu_memory_total)}{on})" if job.gpu_memory_total else ""
    return Figure(
        job.gpu_memory_peak,
        f"the job's peak on one GPU in the recording{total}",
    )


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
