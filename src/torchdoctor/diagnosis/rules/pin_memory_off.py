"""pin-memory-off: a GPU job loads batches with pin_memory=False, so every host-to-device
copy goes through pageable memory (a staging copy, and no overlap with compute)."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import training_loader

ID = "pin-memory-off"


def check(ctx: DiagnosisContext) -> list[Finding]:
    if not ctx.uses_gpu:
        return []
    loader = training_loader(ctx)
    if loader is None or loader["pin_memory"]:
        return []
    summary = ctx.step_summary
    evidence = [
        Evidence("DataLoader pin_memory", "False", ""),
        Evidence("DataLoader batch size", loader["batch_size"] or "unknown", "samples"),
    ]
    if summary is not None:
        evidence.append(
            Evidence(
                "data wait share of step time", round(summary.data_wait_fraction * 100, 1), "%"
            )
        )
    return [
        Finding(
            id=ID,
            severity="info",
            title="Batches reach the GPU from pageable memory (pin_memory=False)",
            evidence=evidence,
            recommendation=(
                "DataLoader(pin_memory=True) and `.to('cuda', non_blocking=True)` on the batch: "
                "pinned pages copy by DMA directly and the copy overlaps with compute."
            ),
            expected_effect="Faster host-to-device copies (up to ~2x per copy) that overlap with compute.",
            confidence=0.6,
            settings={"pin_memory": True},
        )
    ]
