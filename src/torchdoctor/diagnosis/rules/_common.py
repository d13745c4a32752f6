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
