"""gpu-underused: the job's GPU is busy less than the limit while the job runs, with the cause
found by the other rules.

NVML utilization is the share of time in which at least one kernel was running; it is not
how much of the GPU's compute units the kernels used. A low figure means the GPU waits.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import span_evidence

ID = "gpu-underused"
AFTER_OTHERS = True
# Host-side causes that leave a GPU waiting, most direct first.
CAUSES = (
    "dataloader-bound",
    "io-wait",
    "swap-thrash",
    "thread-oversubscription",
    "cpu-saturated",
    "cpu-contention",
    "workers-not-persistent",
    "gpu-throttled",
    "pin-memory-off",
)


def check(ctx: DiagnosisContext) -> list[Finding]:
    findings = []
    limit = ctx.thresholds.gpu_busy_alert_pct
    summary = ctx.step_summary
    for index in ctx.job_gpus:
        series = ctx.gpu_series(index, "utilization_gpu")
        if summary is not None:
            series = [(t, v) for t, v in series if summary.t_start <= t <= summary.t_end] or series
        span = ctx.sustained(series, limit, above=False)
        if span is None:
            continue
        causes = [f for cause in CAUSES for f in ctx.findings if f.id == cause]
        evidence = [
            span_evidence(f"GPU {index} busy (a kernel was running)", span, "%"),
            Evidence("sustained for", round(span.duration, 1), "s", span.t_start, span.t_end),
        ]
        if summary is not None:
            evidence.append(
                Evidence(
                    "data wait share of step time", round(summary.data_wait_fraction * 100, 1), "%"
                )
            )
        settings: dict[str, object] = {}
        if causes:
            main = causes[0]
            settings = dict(main.settings)
            names = ", ".join(dict.fromkeys(f.id for f in causes))
            rec = f"The GPU waits on the host; cause: {names}. First fix: {main.recommendation}"
            expected = main.expected_effect
            confidence = 0.8
        else:
            rec = (
                "No host-side cause was found: the time goes inside the step - Python overhead "
                "between small kernels, synchronising calls (.item(), .cpu(), print of a tensor) "
                "or host-side preprocessing. Profile a few steps with torch.profiler and look "
                "at the gaps between kernels; larger batches or CUDA graphs (torch.compile "
                'mode="reduce-overhead") help launch-bound models.'
            )
            expected = "Higher GPU busy share and shorter steps once the gap is closed."
            confidence = 0.5
        findings.append(
            Finding(
                id=ID,
                severity="warning",
                title=f"GPU {index} is busy only {span.mean:.0f} % of the time",
                evidence=evidence,
                recommendation=rec,
                expected_effect=expected,
                confidence=confidence,
                settings=settings,
                details=(
                    'NVML utilization means "a kernel was running" during the sample window, '
                    "not how much of the GPU the kernels used."
                ),
            )
        )
    return findings
