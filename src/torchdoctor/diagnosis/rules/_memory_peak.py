"""What cuda-oom and cuda-memory-peak say of a memory snapshot: its peak by phase and by line,
as evidence, and the line that held the most (diagnosis.cuda_memory reads the file)."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.cuda_memory import MemoryPeak, RecordedSnapshot, recorded_snapshots
from torchdoctor.diagnosis.findings import Evidence
from torchdoctor.units import fmt_bytes

LINES_SHOWN = 5  # lines named in a finding's evidence (the report's table shows more)


def snapshots(ctx: DiagnosisContext, kind: str) -> list[RecordedSnapshot]:
    """The recording's snapshots of ``kind`` ("oom", "exit"); each file is analysed once
    (cuda_memory.analysed), whichever rule asks first."""
    return [s for s in recorded_snapshots(ctx.recording) if s.kind == kind]


def top_line(peak: MemoryPeak) -> str:
    """'model.py:42 forward held 6.10 GiB of activations at the peak'."""
    if not peak.sites:
        return ""
    site = peak.sites[0]
    return f"{site.where} held {fmt_bytes(site.bytes)} of {site.phase} at the peak"


def peak_evidence(snapshot: RecordedSnapshot) -> list[Evidence]:
    """The snapshot's peak: where it is, allocated and reserved, each phase, the top lines."""
    peak = snapshot.peak
    if peak is None:
        return [Evidence("memory snapshot", f"not read: {snapshot.error}", "")]
    out = [
        Evidence("memory snapshot", snapshot.path, ""),
        Evidence("allocated at the peak (snapshot)", peak.peak_allocated, "B"),
    ]
    if peak.peak_reserved is not None:
        out.append(Evidence("reserved at the peak (snapshot)", peak.peak_reserved, "B"))
    for phase, size in peak.by_phase.items():
        out.append(Evidence(f"{phase} at the peak", size, "B"))
    for site in peak.sites[:LINES_SHOWN]:
        out.append(
            Evidence(
                f"at the peak: {site.where} ({site.phase}, {site.blocks:,} "
                f"block{'s' if site.blocks != 1 else ''})",
                site.bytes,
                "B",
            )
        )
    if peak.fragmentation is not None:
        out.append(Evidence("reserved but free at the snapshot", peak.fragmentation, "B"))
    if peak.largest_free_block is not None:
        out.append(Evidence("largest free block at the snapshot", peak.largest_free_block, "B"))
    if peak.failed is not None:
        out.append(Evidence("request that failed (snapshot)", peak.failed.bytes, "B"))
        if peak.failed.device_free is not None:
            out.append(Evidence("free on the device then", peak.failed.device_free, "B"))
    return out
