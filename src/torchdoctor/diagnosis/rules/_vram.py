"""The batch size that lands a GPU's memory at a target share, from the job's own steps.

After ``optimizer.step()`` the allocator holds what does not depend on the batch (weights,
gradients, optimizer state); the step's peak minus that is the batch's activations, so
memory ~ overhead + ratio * (fixed + per_sample * batch), where ``ratio`` is reserved over
peak allocated (the caching allocator's slack) and ``overhead`` is what NVML sees beyond
torch's reservation (CUDA context, libraries, other processes on the device).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from torchdoctor.diagnosis.context import DiagnosisContext


@dataclass(slots=True)
class VramModel:
    batch_size: int
    fixed: float  # bytes independent of the batch
    per_sample: float  # bytes of activations per sample
    ratio: float  # reserved / peak allocated
    overhead: float  # NVML used minus torch reserved
    total: float  # device memory

    def percent_at(self, batch: int) -> float:
        return (
            (self.overhead + self.ratio * (self.fixed + self.per_sample * batch)) / self.total * 100
        )

    def batch_for(self, target_pct: float) -> int:
        budget = target_pct / 100 * self.total - self.overhead
        batch = math.floor((budget / self.ratio - self.fixed) / self.per_sample)
        if batch >= 16:
            batch -= batch % 8  # multiples of 8 suit tensor cores and are easy to reason about
        return max(batch, 1)


def vram_model(ctx: DiagnosisContext, index: int) -> VramModel | None:
    steps = [
        s
        for s in ctx.steady_steps
        if s["cuda_max_allocated"] and s["cuda_allocated"] is not None and s["batch_size"]
    ]
    if len(steps) < 3:
        return None
    steps = steps[len(steps) // 2 :]  # the settled half
    batch = statistics.mode(s["batch_size"] for s in steps)
    steps = [s for s in steps if s["batch_size"] == batch]
    peak = statistics.median(s["cuda_max_allocated"] for s in steps)
    fixed = statistics.median(s["cuda_allocated"] for s in steps)
    reserved = statistics.median(s["cuda_reserved"] or peak for s in steps)
    per_sample = (peak - fixed) / batch
    samples = ctx.gpu_samples.get(index, [])
    totals = [s["memory_total"] for s in samples if s["memory_total"]]
    used = [s["memory_used"] for s in samples if s["memory_used"] is not None]
    if per_sample <= 0 or not totals or not used:
        return None
    overhead = max(statistics.median(used) - reserved, 0.0)
    return VramModel(
        batch_size=batch,
        fixed=float(fixed),
        per_sample=float(per_sample),
        ratio=max(reserved / peak, 1.0) if peak else 1.0,
        overhead=float(overhead),
        total=float(totals[-1]),
    )


def memory_pct_series(ctx: DiagnosisContext, index: int) -> list[tuple[float, float]]:
    return [
        (s["t"], s["memory_used"] / s["memory_total"] * 100)
        for s in ctx.gpu_samples.get(index, [])
        if s["memory_used"] is not None and s["memory_total"]
    ]
