"""memcpy-bound: in a profiled GPU window host-to-device copies come from pageable memory
(`Memcpy HtoD (Pageable -> Device)`: a staging copy, no overlap with compute), or copies take
`profile_memcpy_alert_pct` of the step or more."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules import _profile as wp
from torchdoctor.recording.profiles import WindowProfile

ID = "memcpy-bound"


def check(ctx: DiagnosisContext) -> list[Finding]:
    t = ctx.thresholds

    def score(w: WindowProfile) -> float | None:
        copies, step_s = wp.per_step(w, "memcpy_s"), wp.step_time(w)
        pageable = wp.per_step(w, "pageable_h2d_count") > 0
        high = wp.pct(copies, step_s) >= t.profile_memcpy_alert_pct
        return copies if step_s > 0 and (pageable or high) else None

    w = wp.pick(ctx, score, gpu=True)
    if w is None:
        return []
    step_s = wp.step_time(w)
    copies, h2d = wp.per_step(w, "memcpy_s"), wp.per_step(w, "memcpy_h2d_s")
    pageable = wp.per_step(w, "pageable_h2d_count")
    share = wp.pct(copies, step_s)
    evidence = wp.window_evidence(w) + [
        Evidence("copies per step", round(copies, 6), "s"),
        Evidence("share of the step", share, "%"),
        Evidence("host-to-device per step", round(h2d, 6), "s"),
        Evidence("pageable host-to-device copies per step", round(pageable, 1), ""),
        Evidence("pageable bytes per step", round(wp.per_step(w, "pageable_h2d_bytes")), "B"),
    ]
    return [
        Finding(
            id=ID,
            severity="warning" if share >= t.profile_memcpy_alert_pct else "info",
            title=(
                f"Copies take {share:g} % of the profiled step"
                + (", from pageable memory" if pageable else "")
            ),
            evidence=evidence,
            recommendation=(
                "DataLoader(pin_memory=True) and `batch.to('cuda', non_blocking=True)`: pinned "
                "pages copy by DMA without a staging copy and the copy overlaps with compute; "
                "tensors made for the GPU are better created there (`torch.randn(..., "
                "device='cuda')`)."
            ),
            expected_effect=(
                f"Saves {wp.at_most(h2d, step_s)}: the host-to-device copy time, if it all "
                "overlaps with compute."
            ),
            confidence=0.7,
            settings={"pin_memory": True, "non_blocking": True},
        )
    ]
