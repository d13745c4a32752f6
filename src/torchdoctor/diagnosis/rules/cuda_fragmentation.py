"""cuda-fragmentation: the caching allocator reserves far more than the job allocates, or had
to free its cache and retry allocations (cudaFree + synchronize on the hot path)."""

from __future__ import annotations

import statistics

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.units import fmt_bytes

ID = "cuda-fragmentation"
GAP_SHARE = 0.3  # reserved but unallocated share of the reservation
GAP_MIN_BYTES = 512 * 2**20
FIX = "expandable_segments:True"


def expandable_on(ctx: DiagnosisContext) -> bool:
    """Whether the job ran with expandable segments on: as a process recorded its setting, or
    in the environment it was started with (PYTORCH_ALLOC_CONF is the newer name)."""
    env = ctx.meta.get("env") or {}
    confs = (
        ctx.setting("env.PYTORCH_CUDA_ALLOC_CONF"),
        env.get("PYTORCH_CUDA_ALLOC_CONF"),
        env.get("PYTORCH_ALLOC_CONF"),
    )
    return any(c and "expandable_segments:true" in str(c).lower() for c in confs)


def check(ctx: DiagnosisContext) -> list[Finding]:
    if not ctx.steps_use_cuda:
        return []  # no step reserved CUDA memory: none is kept below
    steps = [s for s in ctx.steady_steps if s["cuda_reserved"] and s["cuda_max_allocated"]]
    if len(steps) < 3:
        return []
    # The counters are cumulative from the process's start, which is the job's: each
    # process's highest, by SQL (no step row is read).
    retries = 0
    if "cuda_alloc_retries" in ctx.recording.stored_columns("steps"):
        retries = sum(
            r["n"]
            for r in ctx.recording.query(
                "SELECT MAX(cuda_alloc_retries) AS n FROM steps"
                " WHERE cuda_alloc_retries IS NOT NULL GROUP BY pid"
            )
        )
    settled = steps[len(steps) // 2 :]
    reserved = statistics.median(s["cuda_reserved"] for s in settled)
    peak = statistics.median(s["cuda_max_allocated"] for s in settled)
    gap = reserved - peak
    big_gap = gap > GAP_MIN_BYTES and gap > GAP_SHARE * reserved
    if retries <= 0 and not big_gap:
        return []
    if expandable_on(ctx):
        return []  # already on
    t0, t1 = settled[0]["t_start"], settled[-1]["t_end"]
    evidence = [
        Evidence("reserved by the caching allocator", round(reserved), "B", t0, t1),
        Evidence("peak allocated per step", round(peak), "B", t0, t1),
        Evidence("reserved but never allocated", round(gap), "B", t0, t1),
        Evidence("allocation retries (cache flushed and retried)", retries, "retries"),
    ]
    severity = "warning" if retries > 0 else "info"
    return [
        Finding(
            id=ID,
            severity=severity,
            title=(
                f"CUDA memory is fragmented: {fmt_bytes(gap)} reserved beyond the peak"
                + (f", {retries} allocation retries" if retries else "")
            ),
            evidence=evidence,
            recommendation=(
                f"Set PYTORCH_CUDA_ALLOC_CONF={FIX} in the job's environment: segments grow in "
                "place instead of leaving holes between fixed-size blocks. Varying shapes "
                "(variable sequence lengths) fragment most; padding to a few bucket sizes helps too."
            ),
            expected_effect=(
                f"Reserved memory closer to the {fmt_bytes(peak)} actually used; no cache flushes "
                "and retries stalling the step."
            ),
            confidence=0.8 if retries else 0.6,
            settings={"env.PYTORCH_CUDA_ALLOC_CONF": FIX},
        )
    ]
