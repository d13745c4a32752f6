"""comm-exposed: in a profiled GPU window the communication kernels (NCCL) run while no compute
kernel does for more than `profile_comm_exposed_alert_pct` of the step: the all-reduce is not
hidden behind the backward pass."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules import _profile as wp
from torchdoctor.recording.profiles import WindowProfile

ID = "comm-exposed"


def check(ctx: DiagnosisContext) -> list[Finding]:
    limit = ctx.thresholds.profile_comm_exposed_alert_pct

    def score(w: WindowProfile) -> float | None:
        exposed = wp.per_step(w, "comm_exposed_s")
        return exposed if wp.pct(exposed, wp.step_time(w)) > limit else None

    w = wp.pick(ctx, score, gpu=True)
    if w is None:
        return []
    step_s = wp.step_time(w)
    comm, exposed = wp.per_step(w, "comm_gpu_s"), wp.per_step(w, "comm_exposed_s")
    evidence = wp.window_evidence(w) + [
        Evidence("communication kernels per step", round(comm, 6), "s"),
        Evidence("of which no compute overlaps", round(exposed, 6), "s"),
        Evidence("overlapped with compute", wp.pct(comm - exposed, comm), "%"),
        Evidence("exposed share of the step", wp.pct(exposed, step_s), "%"),
    ]
    return [
        Finding(
            id=ID,
            severity="warning",
            title=f"Communication no compute hides: {wp.pct(exposed, step_s):g} % of the profiled step",
            evidence=evidence,
            recommendation=(
                "Let DDP overlap the all-reduce with backward: smaller buckets start it earlier "
                "(`DistributedDataParallel(model, bucket_cap_mb=10, "
                "gradient_as_bucket_view=True)`), accumulate gradients under `model.no_sync()` "
                "to reduce every N steps, or a larger batch per step."
            ),
            expected_effect=f"Saves {wp.at_most(exposed, step_s)}: the exposed communication.",
            confidence=0.6,
            settings={"bucket_cap_mb": 10, "gradient_as_bucket_view": True},
        )
    ]
