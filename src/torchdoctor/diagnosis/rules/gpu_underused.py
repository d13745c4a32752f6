"""gpu-underused: the job's GPU is busy less than the limit while the job runs, with the cause
found by the other rules.

NVML utilization is the share of time in which at least one kernel was running; it is not
how much of the GPU's compute units the kernels used. A low figure means the GPU waits.

Without a host-side cause the time goes inside the step: where a profiled window exists (by
hand, or the automatic one this very case asks for, run/auto_profile.py) the finding points to
what the window's rules found; without one it says how to take one.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import SEVERITIES, Evidence, Finding
from torchdoctor.diagnosis.rules import (
    comm_exposed,
    launch_bound,
    memcpy_bound,
    op_bound,
    python_overhead,
    sync_points,
)
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
# What a profiled window's rules find inside the step (they run before this rule).
INSIDE = tuple(
    m.ID for m in (sync_points, op_bound, launch_bound, python_overhead, memcpy_bound, comm_exposed)
)
# The manual window the advice offers: 5 steps past start-up, as the automatic one takes.
SUGGESTED_STEPS = "20-24"


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
            rec, expected, confidence, settings = _inside_the_step(ctx, evidence)
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


def _inside_the_step(
    ctx: DiagnosisContext, evidence: list[Evidence]
) -> tuple[str, str, float, dict[str, object]]:
    """(recommendation, expected effect, confidence, settings) when no host rule explains the
    waiting GPU: the profiled window's findings where there is one, else how to take one."""
    inside = [f for f in ctx.findings if f.id in INSIDE]
    parsed = [w for w in ctx.profiles if w.steps]  # a failed window has nothing to say
    if parsed:
        window = parsed[0].label
        evidence.append(Evidence("profiled window", window, ""))
        if inside:
            # The most severe first (a warning's share of the step before an info's note),
            # else the order the rules ran in.
            main = min(inside, key=lambda f: SEVERITIES.index(f.severity))
            names = ", ".join(dict.fromkeys(f.id for f in inside))
            return (
                f"No host-side cause was found: the time goes inside the step, and the profiled "
                f"window ({window}) says where: {names}. First fix: {main.recommendation}",
                main.expected_effect,
                0.7,
                dict(main.settings),
            )
        return (
            f"No host-side cause was found, and the profiled window ({window}) names no single "
            "cause inside the step: `torchdoctor show` splits its steps into ops, Python, syncs, "
            "copies and communication. Larger batches or CUDA graphs (torch.compile "
            'mode="reduce-overhead") help a step of many small kernels.',
            "Higher GPU busy share and shorter steps once the gap is closed.",
            0.5,
            {},
        )
    return (
        "No host-side cause was found: the time goes inside the step - Python overhead "
        "between small kernels, synchronising calls (.item(), .cpu(), print of a tensor) "
        "or host-side preprocessing. Profile a few steps with torch.profiler: "
        f"`torchdoctor run --profile-steps {SUGGESTED_STEPS} -- CMD` (or `torchdoctor profile "
        "JOB` while it runs) and diagnose again: the window's findings name the line"
        f"{_why_no_window(ctx)}.",
        "Higher GPU busy share and shorter steps once the gap is closed.",
        0.5,
        {},
    )


def _why_no_window(ctx: DiagnosisContext) -> str:
    """Why this run has no automatic window, where the recording says (run/auto_profile.py)."""
    auto = ctx.meta.get("auto_profile")
    if not isinstance(auto, dict):
        return ""
    state = auto.get("state")
    if state == "off" and auto.get("reason"):
        return f" (the automatic window was off: {auto['reason']})"
    if state == "asked":
        return (
            f" (the automatic window asked for steps {auto.get('first_step')}-"
            f"{auto.get('last_step')} was not taken: the job ended first)"
        )
    return ""
