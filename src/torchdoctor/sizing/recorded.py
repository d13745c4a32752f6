"""What a recording says a job needs: the figures sbatch sizing starts from.

Every figure comes from what the rest of torchdoctor already computes - the recording summary
(peak PSS, CPU use, steps per second) and the diagnosis (the DataLoader the steps consume, the
workers and threads it advises) - so `sbatch` never disagrees with `show` or `diagnose`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from torchdoctor.diagnosis.rules.cpu_saturated import CONTENTION_ID
from torchdoctor.recording.reader import open_recording
from torchdoctor.recording.summary import RunSummary, summarize
from torchdoctor.sampling import roles
from torchdoctor.sampling.types import usable_cpus_of


@dataclass(slots=True)
class RecordedJob:
    """The figures of one recorded run that sizing uses; None where the recording lacks one."""

    path: str
    command: list[str]
    hostname: str | None
    duration_s: float | None
    exit_status: int | None
    ranks: int  # processes that stepped (the trainer of a single-process job counts as one)
    launcher_recorded: bool  # a torchrun agent was part of the recorded job
    pss_peak: int | None  # bytes, whole job (all its processes) at its peak
    rss_peak: int | None
    cores_peak: float | None  # CPU use of the whole job at its peak, in cores
    cores_mean: float | None
    usable_cpus: float | None  # what the job could have used where it was recorded
    step_count: int | None  # steps of one rank
    step_s: float | None  # wall time per job step (1 / steps per second, ranks in parallel)
    overhead_s: float | None  # start-up and shut-down: the run's wall time outside its steps
    num_workers: int | None  # DataLoader workers per rank, as the job ran
    advised_workers: int | None  # what the diagnosis advises (dataloader-bound)
    torch_threads: int | None  # torch.get_num_threads() of the main process, as it ran
    contended: bool  # other programs took the CPUs (diagnosis: cpu-contention)
    gpus_used: int  # GPUs holding the job's memory
    gpu_memory_peak: int | None  # bytes, the most the job held on one GPU
    gpu_name: str | None
    gpu_memory_total: int | None
    network_env: dict[str, str] = field(default_factory=dict)  # the recorded env of interest
    # bytes of shared memory the whole job held at its peak (RssShmem, /dev/shm files); None
    # where the recording predates that sampling
    shm_peak: int | None = None
    findings: list[str] = field(default_factory=list)  # ids of the diagnosis' findings
    # What a damaged recording lost (the reader's Recording.damage, one line each): its
    # figures are what could be read, and sizing says so.
    damage: list[str] = field(default_factory=list)


def read_recorded_job(path: str | os.PathLike[str]) -> RecordedJob:
    """Open ``path`` and pull out the figures sizing needs (UserError if it is no recording)."""
    from torchdoctor.diagnosis.context import DiagnosisContext
    from torchdoctor.diagnosis.engine import diagnose
    from torchdoctor.diagnosis.rules._common import training_loader
    from torchdoctor.thresholds import load_thresholds

    with open_recording(path) as rec:
        summary = summarize(rec)
        thresholds = load_thresholds(None)
        findings = diagnose(rec, thresholds)
        loader = training_loader(DiagnosisContext(rec, thresholds))
        host = rec.meta.get("host") or {}
        env = rec.meta.get("env") or {}
    return _recorded_job(Path(path), summary, findings, loader, host, env)


def _recorded_job(path, summary: RunSummary, findings, loader, host, env) -> RecordedJob:
    steps = summary.steps or {}
    # Steps of one rank (the job's count adds every rank's): ranks step in parallel.
    per_rank = steps.get("per_rank") or []
    step_count = max((r["step_count"] for r in per_rank), default=None) or (
        steps.get("step_count") or None
    )
    steps_per_s = steps.get("steps_per_s")
    step_s = 1.0 / steps_per_s if steps_per_s else None
    overhead = None
    if step_s is not None and step_count and summary.duration_s is not None:
        overhead = max(0.0, summary.duration_s - step_count * step_s)
    ranks = len(per_rank) or summary.roles.get(roles.TRAINER, 0) or 1
    gpu_peaks = [g for g in summary.gpus if g.job_memory_peak]
    top = max(gpu_peaks, key=lambda g: g.job_memory_peak or 0, default=None)
    # Thread advice is left out on purpose: the diagnosis sizes threads to the recording
    # machine's CPUs (or to what other programs left of them); on an allocation of its own
    # the rank's threads follow the CPUs sized here.
    advised_workers = next(
        (int(f.settings["num_workers"]) for f in findings if "num_workers" in f.settings), None
    )
    threads = summary.settings.get("torch.num_threads")
    return RecordedJob(
        path=str(path),
        command=summary.command,
        hostname=host.get("hostname"),
        duration_s=summary.duration_s,
        exit_status=summary.exit_status,
        ranks=ranks,
        launcher_recorded=summary.roles.get(roles.LAUNCHER, 0) > 0,
        pss_peak=_int(summary.job_pss.peak),
        rss_peak=_int(summary.job_rss.peak),
        cores_peak=_cores(summary.job_cpu_pct.peak),
        cores_mean=_cores(summary.job_cpu_pct.mean),
        usable_cpus=usable_cpus_of(host),
        step_count=step_count,
        step_s=step_s,
        overhead_s=overhead,
        num_workers=loader["num_workers"] if loader else None,
        advised_workers=advised_workers,
        torch_threads=threads if isinstance(threads, int) else None,
        contended=any(f.id == CONTENTION_ID for f in findings),
        gpus_used=len(gpu_peaks),
        gpu_memory_peak=top.job_memory_peak if top else None,
        gpu_name=top.name if top else None,
        gpu_memory_total=top.memory_total if top else None,
        network_env=dict(env),  # sizing.network picks the network settings
        shm_peak=_int(summary.job_dev_shm.peak),
        findings=[f.id for f in findings],
        damage=list(summary.damage),
    )


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _cores(pct: float | None) -> float | None:
    return None if pct is None else pct / 100.0
