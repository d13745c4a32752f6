"""python-overhead: the profiled step is spent in Python between ops. On a CPU trace: thousands
of tiny ops - at least `profile_tiny_ops_per_step` top-level ops under 20 us per step - and the
time between ops plus the ops' own time above `profile_python_alert_pct` of the step (the step
is spent dispatching, not computing). On a GPU trace: the GPU idles above
`profile_gpu_idle_alert_pct` of its span, mostly waiting for the host (HTA's host wait above
`profile_launch_wait_pct` of idle), while the host spends above `profile_python_alert_pct` of
the step between ops. Launches that are merely too many are launch-bound's."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules import _profile as wp
from torchdoctor.recording.profiles import WindowProfile

ID = "python-overhead"


def check(ctx: DiagnosisContext) -> list[Finding]:
    gpu = _gpu(ctx)
    return gpu if gpu else _cpu(ctx)


def _gpu(ctx: DiagnosisContext) -> list[Finding]:
    t = ctx.thresholds

    def score(w: WindowProfile) -> float | None:
        span, idle, host = (
            wp.gpu_span(w),
            wp.per_step(w, "gpu_idle_s"),
            wp.per_step(w, "idle_host_s"),
        )
        python_pct = wp.pct(wp.per_step(w, "python_s"), wp.per_step(w, "dur_s"))
        if (
            wp.pct(idle, span) > t.profile_gpu_idle_alert_pct
            and wp.pct(host, idle) >= t.profile_launch_wait_pct
            and python_pct >= t.profile_python_alert_pct
        ):
            return host
        return None

    w = wp.pick(ctx, score, gpu=True)
    if w is None:
        return []
    span, idle = wp.gpu_span(w), wp.per_step(w, "gpu_idle_s")
    host, python_s = wp.per_step(w, "idle_host_s"), wp.per_step(w, "python_s")
    step_s = wp.step_time(w)
    # The GPU can get back at most the time it waited for the host, and no more than the
    # host spent in Python: the ops themselves still have to be launched.
    gain = min(host, python_s)
    evidence = wp.window_evidence(w) + [
        Evidence("GPU idle", wp.pct(idle, span), "% of its span"),
        Evidence("host wait", wp.pct(host, idle), "% of idle"),
        Evidence("between ops (Python) per step", round(python_s, 6), "s"),
        Evidence("ops per step", round(wp.per_step(w, "op_count")), "ops"),
    ]
    return [
        Finding(
            id=ID,
            severity="warning",
            title=f"The GPU waits for Python: idle {wp.pct(idle, span):g} % of its span, mostly for the host",
            evidence=evidence,
            recommendation=(
                "Move the Python work between ops out of the step (logging, per-sample Python, "
                "building tensors on the CPU), or compile the step (`model = "
                "torch.compile(model)`) so the host issues fewer, larger kernels."
            ),
            expected_effect=f"Saves {wp.at_most(gain, step_s)}: the GPU's wait for the host.",
            confidence=0.6,
            settings={"torch_compile": True},
        )
    ]


def _cpu(ctx: DiagnosisContext) -> list[Finding]:
    t = ctx.thresholds

    def score(w: WindowProfile) -> float | None:
        tiny = wp.per_step(w, "tiny_op_count")
        overhead = wp.per_step(w, "python_s") + wp.per_step(w, "ops_s")
        if tiny < t.profile_tiny_ops_per_step:
            return None
        return (
            tiny
            if wp.pct(overhead, wp.per_step(w, "dur_s")) >= t.profile_python_alert_pct
            else None
        )

    w = wp.pick(ctx, score, gpu=False)
    if w is None:
        return []
    step_s = wp.per_step(w, "dur_s")
    tiny, ops = wp.per_step(w, "tiny_op_count"), wp.per_step(w, "op_count")
    python_s = wp.per_step(w, "python_s")
    mean_op = wp.per_step(w, "ops_s") / ops if ops else 0.0
    # Bound: what fusing can save is the time between ops; the profiler's own cost per op is
    # part of what was measured and is taken off.
    gain = max(0.0, python_s - tiny * wp.PROFILER_US_PER_OP * 1e-6) or python_s
    evidence = wp.window_evidence(w) + [
        Evidence("ops per step", round(ops), "ops"),
        Evidence("top-level ops under 20 us per step", round(tiny), "ops"),
        Evidence("mean op self time", round(mean_op, 9), "s"),
        Evidence("between ops (Python) per step", round(python_s, 6), "s"),
        Evidence("share of the step between ops", wp.pct(python_s, step_s), "%"),
    ]
    return [
        Finding(
            id=ID,
            severity="warning",
            title=f"{tiny:.0f} tiny ops per profiled step: the step is spent dispatching them",
            evidence=evidence,
            recommendation=(
                "Replace the Python loop over small tensors with one tensor op (vectorise: index "
                "with a tensor, `torch.stack`, `torch._foreach_*`), or compile the step "
                "(`model = torch.compile(model)`); use `torch.optim.AdamW(..., foreach=True)`."
            ),
            expected_effect=(
                f"Saves {wp.at_most(gain, step_s)}: the time between ops, less the profiler's own "
                f"~{wp.PROFILER_US_PER_OP:g} us per op counted in it."
            ),
            confidence=0.6,
            settings={"torch_compile": True},
        )
    ]
