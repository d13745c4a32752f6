"""launch-bound: in a profiled GPU window the device idles between many small kernels because
launching them is slower than running them - GPU idle above `profile_gpu_idle_alert_pct` of its
span and, of that idle time, kernel wait (a gap under 30 us after a kernel launched in time,
HTA's rule) or short kernels (launch <= 50 us and the kernel shorter than its launch) above
`profile_launch_wait_pct`. Never when the GPU is busy above `profile_gpu_saturated_pct`: a deep
queue makes HTA's short-kernel and delay counts fire on saturated jobs (45 % of a ResNet's
kernels "short" at 96.8 % busy)."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules import _profile as wp
from torchdoctor.recording.profiles import WindowProfile

ID = "launch-bound"


def check(ctx: DiagnosisContext) -> list[Finding]:
    t = ctx.thresholds

    def score(w: WindowProfile) -> float | None:
        span, idle = wp.gpu_span(w), wp.per_step(w, "gpu_idle_s")
        kernels = wp.per_step(w, "kernel_count")
        if span <= 0 or kernels <= 0:
            return None
        busy_pct = wp.pct(wp.per_step(w, "gpu_busy_s"), span)
        if (
            busy_pct > t.profile_gpu_saturated_pct
            or wp.pct(idle, span) <= t.profile_gpu_idle_alert_pct
        ):
            return None
        wait_pct = wp.pct(wp.per_step(w, "idle_kernel_s"), idle)
        short_pct = wp.pct(wp.per_step(w, "short_kernel_count"), kernels)
        return idle if max(wait_pct, short_pct) >= t.profile_launch_wait_pct else None

    w = wp.pick(ctx, score, gpu=True)
    if w is None:
        return []
    span, idle = wp.gpu_span(w), wp.per_step(w, "gpu_idle_s")
    kernels = wp.per_step(w, "kernel_count")
    step_s = wp.step_time(w)
    # What launch overhead can give back: the idle time between kernels that were already
    # launched (kernel wait), not the host's own gaps (host wait is the CPU's time).
    gain = wp.per_step(w, "idle_kernel_s")
    if wp.pct(wp.per_step(w, "short_kernel_count"), kernels) >= t.profile_launch_wait_pct:
        gain = max(gain, idle)
    gain = min(gain, step_s)
    evidence = wp.window_evidence(w) + [
        Evidence("kernels per step", round(kernels), "kernels"),
        Evidence("GPU idle", wp.pct(idle, span), "% of its span"),
        Evidence(
            "kernel wait (gaps < 30 us)", wp.pct(wp.per_step(w, "idle_kernel_s"), idle), "% of idle"
        ),
        Evidence("host wait", wp.pct(wp.per_step(w, "idle_host_s"), idle), "% of idle"),
        Evidence(
            "short kernels", wp.pct(wp.per_step(w, "short_kernel_count"), kernels), "% of kernels"
        ),
    ]
    return [
        Finding(
            id=ID,
            severity="warning",
            title=f"The GPU idles {wp.pct(idle, span):g} % of the step between {kernels:.0f} small kernels",
            evidence=evidence,
            recommendation=(
                "Launch fewer, larger kernels: `torch.compile(model, mode='reduce-overhead')` "
                "(fusion and CUDA graphs), a larger batch where the memory estimate says it fits "
                "(`torchdoctor estimate`), and the fused optimizer (`torch.optim.AdamW(..., "
                "fused=True)`)."
            ),
            expected_effect=f"Saves {wp.at_most(gain, step_s)}: the idle time between kernels.",
            confidence=0.7,
            settings={"torch_compile": "reduce-overhead", "optimizer_fused": True},
        )
    ]
