"""Small helpers several rules share: the training DataLoader, CPU use of the job's parts,
evidence from a sustained span."""

from __future__ import annotations

from typing import Any

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence
from torchdoctor.diagnosis.series import Span, mean


def training_loader(ctx: DiagnosisContext) -> dict[str, Any] | None:
    """The DataLoader the steps consume: the compute processes' loader whose batch size
    matches the steps', else the one with the most batches per epoch."""
    loaders = [d for d in ctx.dataloaders if d["pid"] in ctx.compute_pids] or ctx.dataloaders
    if not loaders:
        return None
    summary = ctx.step_summary
    if summary is not None and summary.batch_size:
        matching = [d for d in loaders if d["batch_size"] == summary.batch_size]
        if matching:
            return matching[0]

    def batches(d: dict[str, Any]) -> float:
        if d["dataset_len"] and d["batch_size"]:
            return d["dataset_len"] / d["batch_size"]
        return 0.0

    return max(loaders, key=batches)


def mean_cpu_cores(ctx: DiagnosisContext, pids: list[int], t0: float, t1: float) -> float | None:
    """Mean CPU use (in cores) summed over ``pids`` between t0 and t1, from process samples."""
    per_t: dict[float, float] = {}
    for pid in pids:
        for s in ctx.samples_by_pid.get(pid, []):
            if t0 <= s["t"] <= t1 and s["cpu_percent"] is not None:
                per_t[s["t"]] = per_t.get(s["t"], 0.0) + s["cpu_percent"] / 100.0
    return mean(list(per_t.values()))


def per_process_mean_cores(
    ctx: DiagnosisContext, pids: list[int], t0: float, t1: float
) -> float | None:
    """Mean CPU use (in cores) of one process of ``pids``, averaged over those processes."""
    values = [
        s["cpu_percent"] / 100.0
        for pid in pids
        for s in ctx.samples_by_pid.get(pid, [])
        if t0 <= s["t"] <= t1 and s["cpu_percent"] is not None
    ]
    return mean(values)


def workers_at_once(
    ctx: DiagnosisContext, t0: float, t1: float, busy_cores: float
) -> tuple[int, int, float]:
    """DataLoader workers as they ran together between t0 and t1: (the most busy workers alive
    at one time, busy workers in all, CPUs all workers used together on average).

    A worker is busy when its mean CPU use over its own samples exceeds ``busy_cores``; its
    lifetime runs from its create time to its last sample (never past its death, so the
    workers of consecutive epochs do not overlap). Workers restarted each epoch are many
    processes but never more than ``num_workers`` at once: only those alive together compete
    for the CPUs. Their CPU is averaged over every instant of the window, epochs without
    workers included."""
    lifetimes: list[tuple[float, float]] = []
    cpu_sum = 0.0
    for pid in ctx.worker_pids:
        samples = [s for s in ctx.samples_by_pid.get(pid, []) if t0 <= s["t"] <= t1]
        cpus = [s["cpu_percent"] / 100.0 for s in samples if s["cpu_percent"] is not None]
        cpu_sum += sum(cpus)
        if cpus and sum(cpus) / len(cpus) > busy_cores:
            born = samples[0]["create_time"]
            born = samples[0]["t"] if born is None else min(born, samples[0]["t"])
            lifetimes.append((born, samples[-1]["t"]))
    # A death sorts before a birth at the same instant: the two never ran together.
    changes = sorted([(b, 1) for b, _ in lifetimes] + [(d, -1) for _, d in lifetimes])
    alive = most = 0
    for _, change in changes:
        alive += change
        most = max(most, alive)
    instants = sum(1 for t, _ in ctx.job_cores_series if t0 <= t <= t1)
    return most, len(lifetimes), cpu_sum / instants if instants else 0.0


def torch_threads(ctx: DiagnosisContext, pid: int) -> int | None:
    value = ctx.setting("torch.num_threads", pid)
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def finding_ids(ctx: DiagnosisContext) -> set[str]:
    return {f.id for f in ctx.findings}


def span_evidence(label: str, span: Span, unit: str) -> Evidence:
    """The series' mean over a sustained span, to a tenth, with the span's times."""
    return Evidence(label, round(span.mean, 1), unit, span.t_start, span.t_end)
