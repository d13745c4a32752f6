"""vram-underused: the job's GPU memory peaks below the best range (60 %); a larger batch
would use the device better. Information, not a fault: small models are fine as they are."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._vram import memory_pct_series, vram_model
from torchdoctor.units import fmt_bytes

ID = "vram-underused"
MAX_SCALE = 8  # a linear model extrapolated further than this is not worth trusting


def check(ctx: DiagnosisContext) -> list[Finding]:
    th = ctx.thresholds
    findings = []
    for index in ctx.job_gpus:
        series = memory_pct_series(ctx, index)
        if len(series) < 3:
            continue
        peak = max(v for _, v in series)
        if peak >= th.gpu_memory_best_low_pct:
            continue
        target = (th.gpu_memory_best_low_pct + th.gpu_memory_best_high_pct) / 2
        model = vram_model(ctx, index)
        evidence = [
            Evidence(f"GPU {index} memory peak", round(peak, 1), "%", series[0][0], series[-1][0])
        ]
        settings: dict[str, object] = {}
        if model is not None:
            batch = min(model.batch_for(target), model.batch_size * MAX_SCALE)
            if batch <= model.batch_size:
                continue
            predicted = model.percent_at(batch)
            settings["batch_size"] = batch
            evidence += [
                Evidence("batch size", model.batch_size, "samples"),
                Evidence("activation memory per sample", round(model.per_sample), "B"),
            ]
            rec = (
                f"batch_size={batch} (from {model.batch_size}) would use about {predicted:.0f} % "
                f"of the GPU's {fmt_bytes(model.total)} ({fmt_bytes(model.per_sample)} per sample); "
                "scale the learning rate with the batch (linear rule or warm-up) and check the "
                "accuracy."
            )
            expected = (
                "More samples per second from the same GPU when the step is not yet GPU-bound."
            )
        else:
            rec = (
                f"The job peaks at {peak:.0f} % of GPU memory: a larger batch (or a larger model) "
                "fits; torchdoctor estimate sizes it."
            )
            expected = "Better use of the GPU."
        findings.append(
            Finding(
                id=ID,
                severity="info",
                title=f"GPU {index} memory peaks at {peak:.0f} %, below the best range",
                evidence=evidence,
                recommendation=rec,
                expected_effect=expected,
                confidence=0.6,
                settings=settings,
            )
        )
    return findings
