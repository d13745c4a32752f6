"""swap-thrash: pages move to and from swap above the table's limit, with memory headroom.

The fix is sized from the shortfall: the swap in use at the worst moment is what the job
must give back; DataLoader workers that each hold private memory are the knob that frees it.
"""

from __future__ import annotations

import math

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import training_loader
from torchdoctor.diagnosis.series import mean
from torchdoctor.units import fmt_bytes, fmt_rate

ID = "swap-thrash"


def check(ctx: DiagnosisContext) -> list[Finding]:
    traffic = [
        (s["t"], float(s["swap_in_per_s"] or 0.0) + float(s["swap_out_per_s"] or 0.0))
        for s in ctx.host_samples
        if s["swap_in_per_s"] is not None or s["swap_out_per_s"] is not None
    ]
    limit = ctx.thresholds.swap_alert_bytes_per_s
    span = ctx.sustained(traffic, limit)
    if span is None:
        return []
    t0, t1 = span.t_start, span.t_end
    within = [s for s in ctx.host_samples if t0 <= s["t"] <= t1]
    swap_used = max((s["swap_used"] for s in within), default=0)
    min_available = min((s["mem_available"] for s in within), default=0)
    faults = mean([s["major_faults_per_s"] for s in within if s["major_faults_per_s"] is not None])
    job_mem = _job_memory(ctx, t0, t1)
    evidence = [
        Evidence("swap traffic (in + out)", round(span.mean), "B/s", t0, t1),
        Evidence("peak swap traffic", round(span.peak), "B/s", t0, t1),
        Evidence("swap in use", swap_used, "B", t0, t1),
        Evidence("lowest available memory", min_available, "B", t0, t1),
        Evidence("memory total", ctx.host.get("mem_total") or 0, "B"),
    ]
    if job_mem is not None:
        evidence.append(
            Evidence("job memory (PSS, summed over its processes)", job_mem, "B", t0, t1)
        )
    if faults is not None:
        evidence.append(Evidence("major page faults", round(faults), "/s", t0, t1))

    settings: dict[str, object] = {}
    shortfall = max(swap_used, 0)
    text = (
        f"The machine swaps {fmt_rate(span.mean)} with {fmt_bytes(min_available)} available at the "
        f"lowest: the job needs {fmt_bytes(shortfall)} less memory"
    )
    text += f" (it holds {fmt_bytes(job_mem)})." if job_mem else "."
    loader = training_loader(ctx)
    worker_private = _worker_private(ctx, t0, t1)
    if loader and loader["num_workers"] and worker_private and shortfall:
        drop = math.ceil(shortfall / worker_private)
        workers = max(loader["num_workers"] - drop, 0)
        if workers < loader["num_workers"]:
            settings["num_workers"] = workers
            text += (
                f" Each DataLoader worker holds {fmt_bytes(worker_private)} of its own: "
                f"num_workers={workers} frees about {fmt_bytes(drop * worker_private)}."
            )
    text += (
        " Keep the data set in a compact form: smaller dtypes (uint8 images, float16 features), "
        "memory-mapped arrays (np.load(..., mmap_mode='r')) instead of Python objects, or load "
        "it lazily from disk."
    )
    return [
        Finding(
            id=ID,
            severity="critical" if span.mean > 10 * limit else "warning",
            title=f"The machine swaps {fmt_rate(span.mean)} while the job runs",
            evidence=evidence,
            recommendation=text,
            expected_effect="Swap traffic back to ~0 KB/s; steps no longer stall on page faults.",
            confidence=0.85,
            settings=settings,
        )
    ]


def _job_memory(ctx: DiagnosisContext, t0: float, t1: float) -> int | None:
    per_t: dict[float, int] = {}
    for samples in ctx.samples_by_pid.values():
        for s in samples:
            if t0 <= s["t"] <= t1:
                per_t[s["t"]] = per_t.get(s["t"], 0) + (
                    s["pss"] if s["pss"] is not None else s["rss"]
                )
    return max(per_t.values()) if per_t else None


def _worker_private(ctx: DiagnosisContext, t0: float, t1: float) -> float | None:
    values = [
        s["uss"]
        for pid in ctx.worker_pids
        for s in ctx.samples_by_pid.get(pid, [])
        if t0 <= s["t"] <= t1 and s["uss"] is not None
    ]
    return mean(values)
