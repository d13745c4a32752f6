"""What a comparison reads from one recording: its steady steps as series per phase, its
settings and environment flattened to ``key -> value``, its memory peaks and how busy the
machine was. :func:`run_figures` is the only reader; everything after it is plain data."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.recording.reader import Recording
from torchdoctor.recording.steps import WARMUP_RULE, measured_steps, step_wait_s
from torchdoctor.recording.summary import summarize

# The phases of a step, as the step rows hold them. "step" and "data_wait" are in every row;
# "compute" is the rest of the step (forward, backward, optimizer, the loop's own code);
# the others only where the agent measured them in every steady step (DDP ranks).
STEP = "step"
DATA_WAIT = "data_wait"
COMPUTE = "compute"
MEASURED_PHASES = {"forward": "forward_s", "backward": "backward_s", "optimizer": "optimizer_s"}
PHASE_LABELS = {
    STEP: "step",
    DATA_WAIT: "data wait",
    COMPUTE: "compute (step - data wait)",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
}

# DataLoader fields compared as settings (its start-up latency is a measure, not a setting).
_LOADER_FIELDS = (
    "batch_size",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "drop_last",
    "multiprocessing_context",
    "dataset_type",
    "dataset_len",
    "sampler_type",
)
_LOADER_FLAGS = ("pin_memory", "persistent_workers", "drop_last")
# Settings that describe the process, not how it was configured, or that are environment.
_NOT_SETTINGS = ("process.role", "torch.version")


@dataclass(slots=True)
class RunFigures:
    """One recording as a comparison sees it."""

    path: str
    command: list[str]
    workload: str | None  # the script (or -m module) the command ran; None when not Python
    batch_size: int | None
    params_count: int | None
    step_count: int
    steady_steps: int
    warmup_rule: str
    # phase -> one value per steady step (seconds), every list the same length
    series: dict[str, list[float]]
    settings: dict[str, Any]  # key -> value: the main process' settings and its DataLoaders
    environment: dict[str, Any]  # key -> value: versions, CPUs, memory, GPUs, env variables
    peak_rss: int | None
    peak_pss: int | None
    peak_vram: int | None  # the job's processes' memory on its busiest GPU, at its peak
    host_cpu_busy_pct: float | None  # mean over the run, percent of the allowed CPUs
    job_cpus: float | None  # mean CPUs the job itself used
    other_cpus: float | None  # mean CPUs everything else on the machine used
    # Share of the run the model processes' main threads waited on a run queue, runnable but
    # without a CPU (/proc/<pid>/schedstat); None in a recording made before it was read.
    run_queue_wait: float | None = None
    notes: list[str] = field(default_factory=list)  # what the figures rest on (cut short...)


def workload_of(command: list[str]) -> str | None:
    """The Python file (or ``-m`` module) a command line runs: what makes two runs the same
    workload whatever their arguments. None when the command runs no Python file."""
    for i, arg in enumerate(command):
        if arg == "-m" and i + 1 < len(command):
            return f"-m {command[i + 1]}"
        if arg.endswith(".py"):
            return os.path.basename(arg)
    return None


def run_figures(rec: Recording) -> RunFigures:
    """Read what a comparison needs from the open recording ``rec``."""
    summary = summarize(rec)
    stats = rec.step_stats()
    rows = rec.frame("steps") if stats is not None else []
    by_pid: dict[int, list[Any]] = defaultdict(list)
    for row in rows:
        by_pid[row["pid"]].append(row)
    steady: list[Any] = []
    # The warm-up rule of every step figure the project prints (recording.steps): the same
    # steps are left out here as in `show`.
    # Where the writer folded steps (recording.compaction) the rows are an evenly spread few
    # of them: a uniform sample of the steady steps, which the bootstrap reads as the steps.
    folded = rec.folded_steps
    for pid in sorted(by_pid):
        rows = sorted(by_pid[pid], key=lambda r: r["step"])
        count = len(rows) + (folded[pid].count if pid in folded else 0)
        steady.extend(measured_steps(rows, count))
    series: dict[str, list[float]] = {
        STEP: [float(r["wall_s"]) for r in steady],
        DATA_WAIT: [step_wait_s(r) for r in steady],
    }
    series[COMPUTE] = [w - d for w, d in zip(series[STEP], series[DATA_WAIT], strict=True)]
    for phase, column in MEASURED_PHASES.items():
        values = [r[column] for r in steady]
        if values and all(v is not None for v in values):
            series[phase] = [float(v) for v in values]

    settings_in = dict(stats.settings) if stats is not None else dict(summary.settings)
    settings: dict[str, Any] = {
        k: v for k, v in settings_in.items() if k not in _NOT_SETTINGS and not k.startswith("env.")
    }
    loaders = sorted(
        stats.dataloaders if stats is not None else [], key=lambda r: r.get("loader_id") or 0
    )
    for i, loader in enumerate(loaders):
        prefix = "dataloader" if len(loaders) == 1 else f"dataloader[{i}]"
        for name in _LOADER_FIELDS:
            value = loader.get(name)
            if name in _LOADER_FLAGS and value is not None:
                value = bool(value)
            settings[f"{prefix}.{name}"] = value

    meta = rec.meta
    host = meta.get("host") or {}
    gpus = meta.get("gpus") or {}
    environment: dict[str, Any] = {
        "torch": meta.get("torch_version") or settings_in.get("torch.version"),
        "torchdoctor": meta.get("torchdoctor_version"),
        "host": host.get("hostname"),
        "cpu model": host.get("cpu_model"),
        "logical CPUs": host.get("logical_cpus"),
        "allowed CPUs": len(host.get("allowed_cpus") or []) or None,
        "cgroup CPU quota": host.get("cgroup_cpu_quota"),
        "cgroup memory limit": host.get("cgroup_memory_limit"),
        "memory": host.get("mem_total"),
        "GPU driver": gpus.get("driver_version"),
        "CUDA driver": gpus.get("cuda_driver_version"),
        "GPUs": ", ".join(str(g.get("name")) for g in gpus.get("gpus") or []) or None,
    }
    for key, value in (meta.get("env") or {}).items():
        environment[f"env {key}"] = value
    for key, value in settings_in.items():
        if key.startswith("env."):
            environment[f"env {key[4:]}"] = value

    allowed = len(host.get("allowed_cpus") or []) or host.get("logical_cpus")
    busy = summary.host_cpu_busy_pct.mean
    job_cpus = summary.job_cpu_pct.mean / 100 if summary.job_cpu_pct.mean is not None else None
    other = None
    if busy is not None and allowed and job_cpus is not None:
        other = max(0.0, busy / 100 * allowed - job_cpus)
    params = settings_in.get("params.count")
    vram = [g.job_memory_peak for g in summary.gpus if g.job_memory_peak is not None]
    notes = list(rec.notes())
    if summary.steps_source_limit:  # an attach whose sampled steps merge
        notes.append(
            "its steps were seen by sampling the job's stack and merge: its step time is an"
            " upper bound, its rate a lower bound (record both runs with `torchdoctor run`)"
        )
    return RunFigures(
        path=str(rec.path),
        command=list(summary.command),
        workload=workload_of(list(summary.command)),
        batch_size=stats.batch_size if stats is not None else None,
        params_count=params if isinstance(params, int) else None,
        step_count=stats.step_count if stats is not None else 0,
        steady_steps=stats.measured_steps if stats is not None else 0,
        warmup_rule=WARMUP_RULE,
        series=series,
        settings=settings,
        environment=environment,
        peak_rss=_int(summary.job_rss.peak),
        peak_pss=_int(summary.job_pss.peak),
        peak_vram=max(vram) if vram else None,
        host_cpu_busy_pct=busy,
        job_cpus=job_cpus,
        other_cpus=other,
        notes=notes,
        run_queue_wait=run_queue_wait(rec, _span(steady)),
    )


def _span(steps: list[Any]) -> tuple[float, float] | None:
    """From the first steady step's start to the last one's end: the time compared."""
    starts = [r["t_start"] for r in steps if r["t_start"] is not None]
    ends = [r["t_end"] for r in steps if r["t_end"] is not None]
    return (min(starts), max(ends)) if starts and ends else None


def run_queue_wait(rec: Recording, span: tuple[float, float] | None) -> float | None:
    """The share of their time the model processes (trainers, ranks) waited on a run queue
    for a CPU during ``span`` (the steady steps: start-up's imports wait too on a busy
    machine, and say nothing of the steps): their waits added up over their times added up.
    None when no such process's waits were read in it (an older recording, a kernel without
    schedstat, a span shorter than the sampling interval)."""
    if span is None or "run_delay_s" not in rec.stored_columns("process_samples"):
        return None
    rows = rec.query(
        "SELECT MAX(run_delay_s) - MIN(run_delay_s) AS waited, MAX(t) - MIN(t) AS span"
        " FROM process_samples WHERE run_delay_s IS NOT NULL AND t >= ? AND t <= ?"
        " GROUP BY pid, create_time",
        span,
    )
    waited = sum(r["waited"] for r in rows if r["span"])
    span = sum(r["span"] for r in rows if r["span"])
    return waited / span if span > 0 else None


def _int(value: float | None) -> int | None:
    return int(value) if value is not None else None
