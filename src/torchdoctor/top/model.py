"""From readings of the machine to what ``torchdoctor top`` shows: a pure function.

:func:`build_view` takes one :class:`TopReadings` (host, GPUs, the PyTorch jobs found on the
machine, with what their recordings say), the threshold table and the interface state (sort,
filter, selection), and returns a :class:`View`: rows already grouped, sorted, filtered and
labelled with their level (``ok``, ``warn``, ``alert``) from the same threshold table the
diagnosis uses. Nothing here touches the terminal or /proc, so it is tested with plain data.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from torchdoctor.sampling import roles
from torchdoctor.sampling.types import (
    GpuProcessSample,
    GpuSample,
    GpuStatus,
    HostSample,
    ProcessInfo,
    ProcessSample,
)
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.compact import printable

SORT_KEYS = ("cpu", "mem", "vram", "pid")  # cycled by the ``s`` key
SORT_LABELS = {"cpu": "CPU%", "mem": "PSS", "vram": "VRAM", "pid": "PID"}
# Share of step time spent waiting for data above which a job counts as starved: the anchor
# rule of the PyTorch profiler's TensorBoard plugin (DataLoader time > 5 % of the step).
DATA_WAIT_STARVED = 0.05
# Environment variables worth seeing in a process's detail: threading, devices, distribution.
ENV_OF_INTEREST = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "KMP_AFFINITY",
    "GOMP_CPU_AFFINITY",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUBLAS_WORKSPACE_CONFIG",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
ENV_PREFIXES_OF_INTEREST = ("NCCL_", "TORCH_", "TORCHDOCTOR_")


# -- inputs -----------------------------------------------------------------------------


@dataclass(slots=True)
class FindingBrief:
    """One current finding of the diagnosis, as much as a live view line can carry."""

    id: str
    severity: str  # "critical", "warning", "info"
    title: str
    recommendation: str = ""


@dataclass(slots=True)
class RecordingStatus:
    """What the recording of a job under ``torchdoctor run`` says about its recent steps."""

    path: str
    steps: int  # steps recorded so far
    step_rate_per_s: float | None  # over the recent window
    samples_per_s: float | None
    data_wait_share: float | None  # 0-1: time blocked in DataLoader next() / step time
    window_s: float = 10.0  # the figures are over the steps that ended in this window
    stalled_s: float | None = None  # seconds since the last step, when far over a step's time
    # Steps seen by sampling an attached job's stack that merge: the rate is a lower bound.
    rate_lower_bound: bool = False
    findings: list[FindingBrief] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    # Said when the recording is not being written as it should: its recorder died (cut
    # short) or has written nothing for long. None while it is in progress and fresh.
    recording_note: str | None = None


@dataclass(slots=True)
class JobReading:
    """One PyTorch job: its root process and every process under it, with their roles."""

    root_pid: int
    processes: list[ProcessSample]
    info: dict[int, ProcessInfo]
    recording: RecordingStatus | None = None


@dataclass(slots=True)
class ProcessDetail:
    """The slow, on-demand part of one process: read only while its detail is open."""

    pid: int
    cmdline: list[str]
    username: str | None
    own: bool  # belongs to the user running top: signals may be sent
    state: str | None
    create_time: float | None
    env: dict[str, str] | None  # only the variables of interest
    env_unavailable: str | None = None  # why ``env`` is None
    cpu_affinity: list[int] | None = None


@dataclass(slots=True)
class ProcessHistory:
    """Recent values of one process, oldest first, for the detail sparklines."""

    cpu_percent: list[float | None] = field(default_factory=list)
    rss: list[float | None] = field(default_factory=list)
    gpu_memory: list[float | None] = field(default_factory=list)


@dataclass(slots=True)
class TopReadings:
    """Everything one refresh of ``top`` read."""

    t: float
    interval_s: float
    hostname: str
    host: HostSample | None
    usable_cpus: int
    gpu_status: GpuStatus
    gpus: list[GpuSample]
    gpu_processes: list[GpuProcessSample]
    jobs: list[JobReading]
    history: dict[int, ProcessHistory] = field(default_factory=dict)  # of the detail's process
    detail: ProcessDetail | None = None
    notes: list[str] = field(default_factory=list)  # e.g. processes that could not be read
    process_names: dict[int, str] = field(default_factory=dict)  # GPU processes outside jobs


@dataclass(slots=True)
class UiState:
    """What the person chose: kept by the app between refreshes, changed by keys."""

    sort: str = "cpu"
    filter: str = ""
    selected_pid: int | None = None
    detail_pid: int | None = None
    mode: str = "normal"  # "normal", "filter", "signal", "confirm", "help"
    pending_signal: str | None = None  # e.g. "SIGTERM" while confirming
    message: str | None = None  # one-line feedback (signal sent, permission denied...)


# -- outputs ----------------------------------------------------------------------------


@dataclass(slots=True)
class CoreView:
    index: int
    user: float  # user + nice
    system: float  # system + irq + softirq
    iowait: float
    steal: float


@dataclass(slots=True)
class HostView:
    cpu_busy: float | None
    cpu_level: str
    user: float | None
    system: float | None
    iowait: float | None
    iowait_level: str
    steal: float | None
    cores: list[CoreView]
    load: tuple[float, float, float]
    run_queue: int
    blocked: int
    usable_cpus: int
    mem_used: int
    mem_total: int
    swap_used: int
    swap_total: int
    swap_in_per_s: float | None
    swap_out_per_s: float | None
    swap_level: str
    psi: dict[str, float | None]
    unavailable: dict[str, str]
    cgroup_throttled: float | None = None  # share of time the cgroup's CPU quota held us back


@dataclass(slots=True)
class GpuRow:
    index: int
    name: str
    utilization: float | None
    memory_used: int | None
    memory_total: int | None
    memory_pct: float | None
    memory_level: str
    power_w: float | None
    power_limit_w: float | None
    temperature_c: float | None
    throttle: list[str] | None
    unavailable: dict[str, str]


@dataclass(slots=True)
class GpuProcessRow:
    gpu_index: int
    pid: int  # as NVML reports it
    local_pid: int | None  # None: not resolvable in this PID namespace
    used_memory: int | None
    job_root: int | None  # the job it belongs to, when it is one of ours
    name: str | None


@dataclass(slots=True)
class ProcessRow:
    pid: int
    ppid: int
    create_time: float  # with the PID, the identity a signal is checked against
    depth: int  # indentation under the job root
    role: str
    rank: int | None
    name: str
    command: str
    cpu_percent: float | None
    threads: int
    rss: int
    pss: int | None
    gpu_memory: int | None
    matched: bool  # matches the filter (rows shown for context are dimmed)
    uss: int | None = None
    swap: int | None = None
    read_bytes_per_s: float | None = None
    write_bytes_per_s: float | None = None
    ctx_involuntary_per_s: float | None = None  # preempted: waiting for a CPU


@dataclass(slots=True)
class JobView:
    root_pid: int
    command: str
    ranks: list[int]
    workers: int
    process_count: int
    cpu_percent: float
    threads: int
    rss: int
    pss: int | None
    gpu_memory: int | None
    recording: RecordingStatus | None
    status: str  # one short phrase: "starved: waits for data 41 % of step"
    status_level: str
    rows: list[ProcessRow]


@dataclass(slots=True)
class DetailView:
    row: ProcessRow
    job_root: int
    detail: ProcessDetail | None
    history: ProcessHistory


@dataclass(slots=True)
class View:
    t: float
    interval_s: float
    hostname: str
    host: HostView | None
    gpu_unavailable: str | None  # the one line shown when NVML cannot be used
    gpus: list[GpuRow]
    gpu_processes: list[GpuProcessRow]
    jobs: list[JobView]
    detail: DetailView | None
    state: UiState
    notes: list[str]

    def rows(self) -> list[ProcessRow]:
        """Every process row on screen, in screen order (what the selection moves over)."""
        return [r for job in self.jobs for r in job.rows]


# -- building ---------------------------------------------------------------------------


def build_view(readings: TopReadings, thresholds: Thresholds, state: UiState) -> View:
    """The view model of one refresh: pure, deterministic, no I/O."""
    jobs = [_job_view(job, state) for job in readings.jobs]
    jobs = [j for j in jobs if j.rows]
    jobs.sort(key=lambda j: _job_sort_key(j, state.sort))
    pid_to_job = {p.pid: job.root_pid for job in readings.jobs for p in job.processes}
    names = dict(readings.process_names)
    names.update({p.pid: p.name for job in readings.jobs for p in job.processes})
    view = View(
        t=readings.t,
        interval_s=readings.interval_s,
        hostname=readings.hostname,
        host=_host_view(readings.host, readings.usable_cpus, thresholds),
        gpu_unavailable=None if readings.gpu_status.available else _nvml_line(readings.gpu_status),
        gpus=[_gpu_row(g, readings.gpu_status, thresholds) for g in readings.gpus],
        gpu_processes=[
            GpuProcessRow(
                gpu_index=gp.gpu_index,
                pid=gp.pid,
                local_pid=gp.local_pid,
                used_memory=gp.used_memory,
                job_root=pid_to_job.get(gp.local_pid) if gp.local_pid is not None else None,
                name=names.get(gp.local_pid) if gp.local_pid is not None else None,
            )
            for gp in sorted(
                readings.gpu_processes, key=lambda g: (g.gpu_index, -(g.used_memory or 0))
            )
        ],
        jobs=jobs,
        detail=None,
        state=state,
        notes=list(readings.notes),
    )
    view.detail = _detail_view(view, readings, state)
    return view


def _nvml_line(status: GpuStatus) -> str:
    return f"GPUs: none shown: {status.reason or 'NVML is unavailable'}"


def _host_view(host: HostSample | None, usable_cpus: int, th: Thresholds) -> HostView | None:
    if host is None:
        return None
    ids = host.per_core_ids or list(range(len(host.per_core or [])))
    cores = [
        CoreView(
            index=ids[i] if i < len(ids) else i,
            user=c.user + c.nice,
            system=c.system + c.irq + c.softirq,
            iowait=c.iowait,
            steal=c.steal,
        )
        for i, c in enumerate(host.per_core or [])
    ]
    swap_traffic = (
        None
        if host.swap_in_per_s is None or host.swap_out_per_s is None
        else host.swap_in_per_s + host.swap_out_per_s
    )
    cpu = host.cpu
    return HostView(
        cpu_busy=host.cpu_busy,
        cpu_level=th.level("cpu_load_pct", host.cpu_busy),
        user=None if cpu is None else cpu.user + cpu.nice,
        system=None if cpu is None else cpu.system + cpu.irq + cpu.softirq,
        iowait=None if cpu is None else cpu.iowait,
        iowait_level=th.level("iowait_pct", None if cpu is None else cpu.iowait),
        steal=None if cpu is None else cpu.steal,
        cores=cores,
        load=(host.load1, host.load5, host.load15),
        run_queue=host.procs_running,
        blocked=host.procs_blocked,
        usable_cpus=usable_cpus,
        mem_used=host.mem_used,
        mem_total=host.mem_total,
        swap_used=host.swap_used,
        swap_total=host.swap_total,
        swap_in_per_s=host.swap_in_per_s,
        swap_out_per_s=host.swap_out_per_s,
        swap_level=th.level("swap_bytes_per_s", swap_traffic),
        psi={
            "cpu": host.psi_cpu_some,
            "mem": host.psi_memory_some,
            "io": host.psi_io_some,
        },
        unavailable=dict(host.unavailable),
        cgroup_throttled=host.cgroup_throttled_per_s,
    )


def _gpu_row(g: GpuSample, status: GpuStatus, th: Thresholds) -> GpuRow:
    names = {info.index: info.name for info in status.gpus}
    mem_pct = None
    if g.memory_used is not None and g.memory_total:
        mem_pct = 100.0 * g.memory_used / g.memory_total
    return GpuRow(
        index=g.index,
        name=names.get(g.index, f"GPU {g.index}"),
        utilization=g.utilization_gpu,
        memory_used=g.memory_used,
        memory_total=g.memory_total,
        memory_pct=mem_pct,
        memory_level=th.level("gpu_memory_pct", mem_pct),
        power_w=g.power_w,
        power_limit_w=g.power_limit_w,
        temperature_c=g.temperature_c,
        throttle=g.clock_event_reasons,
        unavailable=dict(g.unavailable),
    )


def short_command(cmdline: list[str], name: str) -> str:
    """The command as a person recognizes it: program and script paths dropped, ``-c`` code
    cut to its first line."""
    if not cmdline:
        return f"[{name}]"
    argv = list(cmdline)
    argv[0] = os.path.basename(argv[0])
    if len(argv) > 1 and not argv[1].startswith("-") and "/" in argv[1]:
        # "python /long/path/to/train.py": the script's name is what tells jobs apart; the
        # full command line is in the process's detail.
        argv[1] = os.path.basename(argv[1])
    if len(argv) > 2 and argv[1] == "-c":
        # Code passed with -c is often many lines: its first line tells enough.
        argv[2] = argv[2].strip().splitlines()[0] if argv[2].strip() else ""
    return printable(" ".join(shlex.quote(a) if " " in a and len(a) < 40 else a for a in argv))


def _matches(text: str, p: ProcessSample, command: str) -> bool:
    needle = text.lower()
    return (
        needle in command.lower()
        or needle in p.name.lower()
        or needle in p.role
        or needle == str(p.pid)
        or (p.rank is not None and needle == f"rank{p.rank}")
    )


def _row_key(row: ProcessRow, sort: str) -> tuple:
    # Trainers and ranks before their workers whatever the sort: the grouping must stay legible.
    role_order = 0 if row.role in (roles.LAUNCHER, roles.TRAINER) else 1
    if sort == "pid":
        return (role_order, row.rank if row.rank is not None else -1, row.pid)
    value = {
        "cpu": row.cpu_percent,
        "mem": row.pss if row.pss is not None else row.rss,
        "vram": row.gpu_memory,
    }[sort]
    return (role_order, row.rank if row.rank is not None else -1, -(value or 0), row.pid)


def _job_view(job: JobReading, state: UiState) -> JobView:
    by_pid = {p.pid: p for p in job.processes}
    children: dict[int, list[int]] = {}
    for p in job.processes:
        if p.pid != job.root_pid and p.ppid in by_pid:
            children.setdefault(p.ppid, []).append(p.pid)
    orphans = [
        p.pid for p in job.processes if p.pid != job.root_pid and p.ppid not in by_pid
    ]  # reparented (e.g. to a subreaper) but still part of the job

    def make_row(p: ProcessSample, depth: int) -> ProcessRow:
        info = job.info.get(p.pid)
        command = short_command(info.cmdline if info else [], p.name)
        return ProcessRow(
            pid=p.pid,
            ppid=p.ppid,
            create_time=p.create_time,
            depth=depth,
            role=p.role,
            rank=p.rank,
            name=p.name,
            command=command,
            cpu_percent=p.cpu_percent,
            threads=p.threads,
            rss=p.rss,
            pss=p.pss,
            gpu_memory=p.gpu_memory,
            matched=not state.filter or _matches(state.filter, p, command),
            uss=p.uss,
            swap=p.swap,
            read_bytes_per_s=p.read_bytes_per_s,
            write_bytes_per_s=p.write_bytes_per_s,
            ctx_involuntary_per_s=p.ctx_involuntary_per_s,
        )

    rows: list[ProcessRow] = []

    def walk(pid: int, depth: int) -> None:
        row = make_row(by_pid[pid], depth)
        rows.append(row)
        kids = [make_row(by_pid[c], depth + 1) for c in children.get(pid, [])]
        for kid in sorted(kids, key=lambda r: _row_key(r, state.sort)):
            walk(kid.pid, depth + 1)

    if job.root_pid in by_pid:
        walk(job.root_pid, 0)
    for pid in orphans:
        walk(pid, 1)

    command = rows[0].command if rows else ""
    if state.filter and not any(r.matched for r in rows):
        rows = []
    elif state.filter and not rows[0].matched:
        # Keep the rows that match and the path up to them, so grouping stays readable.
        keep = {r.pid for r in rows if r.matched}
        for r in rows:
            if r.pid in keep:
                parent = r.ppid
                while parent in by_pid and parent not in keep:
                    keep.add(parent)
                    parent = by_pid[parent].ppid
        rows = [r for r in rows if r.pid in keep]

    procs = job.processes
    pss_known = [p.pss for p in procs if p.pss is not None]
    vram_known = [p.gpu_memory for p in procs if p.gpu_memory is not None]
    status, level = _job_status(job)
    return JobView(
        root_pid=job.root_pid,
        command=command,
        ranks=sorted({p.rank for p in procs if p.rank is not None}),
        workers=sum(1 for p in procs if p.role == roles.WORKER),
        process_count=len(procs),
        cpu_percent=sum(p.cpu_percent or 0.0 for p in procs),
        threads=sum(p.threads for p in procs),
        rss=sum(p.rss for p in procs),
        pss=sum(pss_known) if len(pss_known) == len(procs) else None,
        gpu_memory=sum(vram_known) if vram_known else None,
        recording=job.recording,
        status=status,
        status_level=level,
        rows=rows,
    )


def _job_status(job: JobReading) -> tuple[str, str]:
    """One phrase saying whether the job is starved and why, with its level."""
    rec = job.recording
    if rec is not None:
        if rec.stalled_s is not None:
            # What the job is doing now comes before what the whole recording says.
            return f"stalled: no step for {rec.stalled_s:.0f} s", "warn"
        worst = _worst_finding(rec.findings)
        if worst is not None:
            level = {"critical": "alert", "warning": "warn"}.get(worst.severity, "ok")
            return worst.title, level
        if rec.data_wait_share is not None and rec.data_wait_share > DATA_WAIT_STARVED:
            return (
                f"starved: waits for data {100 * rec.data_wait_share:.0f} % of step time",
                "alert",
            )
        if rec.step_rate_per_s is not None:
            return "not waiting for data", "ok"
        return "recording, no steps yet", "ok"
    return _starvation_hint(job)


# Without a recording there is no step time to split, but the CPU of the processes tells a
# data-starved job apart: its workers run flat out producing batches while the trainer, which
# waits for them, is mostly idle. (A GPU-bound trainer busy-waits on CUDA near 100 %.)
WORKER_SATURATED_PCT = 80.0
TRAINER_IDLE_PCT = 50.0


def _starvation_hint(job: JobReading) -> tuple[str, str]:
    trainers = [p.cpu_percent for p in job.processes if p.role == roles.TRAINER]
    workers = [p.cpu_percent for p in job.processes if p.role == roles.WORKER]
    if not trainers or not workers or None in trainers or None in workers:
        return "", "ok"
    worker_mean = sum(workers) / len(workers)  # type: ignore[arg-type]
    trainer_mean = sum(trainers) / len(trainers)  # type: ignore[arg-type]
    if worker_mean >= WORKER_SATURATED_PCT and trainer_mean < TRAINER_IDLE_PCT:
        return (
            f"likely starved: {len(workers)} workers at {worker_mean:.0f} % CPU, "
            f"trainer at {trainer_mean:.0f} %",
            "warn",
        )
    return "", "ok"


def _worst_finding(findings: Iterable[FindingBrief]) -> FindingBrief | None:
    order = {"critical": 0, "warning": 1, "info": 2}
    ranked = sorted(findings, key=lambda f: order.get(f.severity, 3))
    return ranked[0] if ranked else None


def _job_sort_key(job: JobView, sort: str) -> tuple:
    if sort == "pid":
        return (job.root_pid,)
    value = {
        "cpu": job.cpu_percent,
        "mem": job.pss if job.pss is not None else job.rss,
        "vram": job.gpu_memory,
    }[sort]
    return (-(value or 0), job.root_pid)


def _detail_view(view: View, readings: TopReadings, state: UiState) -> DetailView | None:
    if state.detail_pid is None:
        return None
    for job in view.jobs:
        for row in job.rows:
            if row.pid == state.detail_pid:
                detail = (
                    readings.detail if readings.detail and readings.detail.pid == row.pid else None
                )
                history = readings.history.get(row.pid, ProcessHistory())
                return DetailView(row=row, job_root=job.root_pid, detail=detail, history=history)
    return None


def env_of_interest(environ: dict[str, str]) -> dict[str, str]:
    """The variables that change threading, device visibility or distribution, sorted."""
    return {
        k: environ[k]
        for k in sorted(environ)
        if k in ENV_OF_INTEREST or k.startswith(ENV_PREFIXES_OF_INTEREST)
    }
