"""cuda-memory-peak: what filled the GPU at its peak, by phase and by source line.

With ``run --memory-history`` every process using CUDA writes a memory snapshot when it ends
(instrument/agent/cuda.py). When its memory came near the GPU's size - vram-near-full fired, or
the snapshot's peak reservation reached the threshold table's alert (90 %) of the device - this
names what was live at that peak (diagnosis.cuda_memory): the phase that held the most and the
lines that allocated it, so the fix aims at the right part. A job that ran out of memory gets
this from cuda-oom instead, from the snapshot taken at the OOM.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.cuda_memory import (
    ACTIVATIONS,
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    MemoryPeak,
    phase_split,
)
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules import vram_near_full
from torchdoctor.diagnosis.rules._common import finding_ids
from torchdoctor.diagnosis.rules._memory_peak import peak_evidence, snapshots, top_line
from torchdoctor.instrument.agent.cuda import HISTORY_ENTRIES
from torchdoctor.units import fmt_bytes

ID = "cuda-memory-peak"
# Reads whether vram-near-full fired: it runs before this rule (RULE_MODULES' order).
# What to change, by the phase that held the most at the peak.
FIXES = {
    ACTIVATIONS: (
        "Activations held the most: a smaller micro-batch with gradient accumulation, bf16 "
        "autocast or activation checkpointing of the blocks at the lines above"
    ),
    GRADIENTS: (
        "Gradients held the most: bf16 weights halve them; sharding (FSDP / ZeRO-2) splits "
        "them across GPUs; set_to_none=True in zero_grad frees them between steps"
    ),
    OPTIMIZER_STATE: (
        "Optimizer state held the most: an 8-bit optimizer (bitsandbytes AdamW8bit) keeps a "
        "quarter of it; sharding it (FSDP / ZeRO-1) splits it across GPUs"
    ),
    PARAMETERS: ("Parameters held the most: bf16 weights halve them; FSDP shards them across GPUs"),
}


def check(ctx: DiagnosisContext) -> list[Finding]:
    if ctx.events_of("cuda-oom"):
        return []  # cuda-oom explains the peak from its own snapshot
    near_full = vram_near_full.ID in finding_ids(ctx)
    findings = []
    for snapshot in snapshots(ctx, "exit"):
        peak = snapshot.peak
        if peak is None:
            continue  # unreadable: `show` says why; no finding rests on it
        total = _device_total(ctx, peak)
        share = 100.0 * (peak.peak_reserved or peak.peak_allocated) / total if total else None
        if not near_full and (share is None or share < ctx.thresholds.gpu_memory_alert_pct):
            continue
        findings.append(_finding(peak, peak_evidence(snapshot), total, share))
    return findings


def _finding(
    peak: MemoryPeak, evidence: list[Evidence], total: int | None, share: float | None
) -> Finding:
    phase, _ = peak.top_phase()
    if total:
        evidence.append(Evidence("GPU memory", total, "B"))
    if share is not None:
        evidence.append(Evidence("reserved at the peak, share of the GPU", round(share, 1), "%"))
    line = top_line(peak)
    fix = FIXES.get(
        phase,
        "Most of the peak has no line in the snapshot: it was allocated before the history the "
        f"allocator kept (its last {HISTORY_ENTRIES:,} events) begins; the lines above hold the "
        "rest",
    )
    return Finding(
        id=ID,
        severity="info",
        title=f"CUDA memory peaked at {fmt_bytes(peak.peak_allocated)} allocated"
        + (f": {line}" if line else ""),
        evidence=evidence,
        recommendation=f"{fix}.",
        expected_effect=(
            f"The peak falls by what the change saves of the {fmt_bytes(peak.by_phase.get(phase, 0))}"
            f" of {phase}: room below the GPU's size."
        ),
        confidence=0.8,
        details=f"At the peak the memory snapshot shows {phase_split(peak)}.",
    )


def _device_total(ctx: DiagnosisContext, peak: MemoryPeak) -> int | None:
    """The size of the device the snapshot was taken on: the GPU of that index the recording
    saw, else the largest of the job's GPUs."""
    info = ctx.gpu_infos.get(peak.device) or {}
    if info.get("memory_total"):
        return int(info["memory_total"])
    totals = [i.get("memory_total") or 0 for i in ctx.gpu_infos.values()]
    return max(totals) if any(totals) else None
