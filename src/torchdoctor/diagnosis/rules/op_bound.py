"""op-bound: in a profiled window one op - one name, one shape, one dtype - takes most of the
step (above `profile_hot_op_pct` of it: CPU ops' self time on a CPU trace; on a GPU trace one
kernel's share of a GPU busy above `profile_gpu_saturated_pct`; on a CPU trace only when the
step is not mostly Python, below `profile_python_alert_pct`), with the ops that make up
`profile_ops_cover_pct` of the op time, their shapes and dtypes. The fix follows the op's class:
an fp32 matmul or convolution on a tensor-core GPU (compute capability 7 and later) -> AMP
(bf16) or TF32; a chain of elementwise ops -> torch.compile. The time outside the DataLoader's
`__next__` only: a data-bound step is dataloader-bound's. Not for an op whose time is one call
(preempted, or a one-off) nor for thousands of calls under 20 us each (python-overhead's).
Per-step figures are medians over the judged steps."""

from __future__ import annotations

import json
import re
from typing import Any

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules import _profile as wp
from torchdoctor.recording.profiles import WindowProfile

ID = "op-bound"
TINY_CALL_S = 20e-6  # as the parser's tiny top-level ops
MATMUL_OPS = re.compile(
    r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_?convolution|conv\dd|mkldnn_convolution|cudnn_convolution|_scaled_dot_product)"
)
MATMUL_KERNELS = re.compile(r"gemm|cutlass|cublas|conv|cudnn|xmma|wgmma", re.I)
ELEMENTWISE_KERNELS = re.compile(r"elementwise|vectorized|reduce_kernel|unrolled", re.I)
ELEMENTWISE_OPS = re.compile(
    r"^aten::(add|sub|mul|div|relu|gelu|silu|sigmoid|tanh|exp|log|pow|sqrt|rsqrt|neg|where|"
    r"clamp|clamp_min|threshold|masked_fill|fill|copy|abs|maximum|minimum)_?$"
)


def check(ctx: DiagnosisContext) -> list[Finding]:
    best: tuple[float, Finding] | None = None
    for w in ctx.profiles:
        finding = _gpu(ctx, w) if w.gpu else _cpu(ctx, w)
        if finding is not None and (best is None or finding[0] > best[0]):
            best = finding
    return [best[1]] if best else []


def _shape(op: dict[str, Any]) -> str:
    dims = op.get("input_dims")
    types = op.get("input_types")
    try:
        shapes = [d for d in json.loads(dims) if d] if dims else []
        dtypes = sorted({x for x in json.loads(types) if x and x != "Scalar"}) if types else []
    except ValueError:
        return ""
    out = " x ".join("[" + ", ".join(str(n) for n in d) + "]" for d in shapes)
    return f"{out} {'/'.join(dtypes)}".strip()


def _label(op: dict[str, Any]) -> str:
    shape = _shape(op)
    return f"{op['name']} {shape}" if shape else op["name"]


def _one_off(op: dict[str, Any]) -> bool:
    calls, longest, own = op["count"] or 0, op.get("max_s"), op["self_s"] or 0.0
    return calls > 1 and longest is not None and longest > 0.5 * own


def _cpu(ctx: DiagnosisContext, w: WindowProfile) -> tuple[float, Finding] | None:
    t = ctx.thresholds
    n = len(w.steps)
    step_s = wp.per_step(w, "dur_s")
    if not w.ops or not n or step_s <= 0:
        return None
    # An op whose time is mostly one call (preempted, or a one-off) is not the step's cost.
    steady = [op for op in w.ops if not _one_off(op)]
    if not steady:
        return None
    top = steady[0]
    top_s = (top["self_s"] or 0.0) / n
    share = wp.pct(top_s, step_s)
    # A step spent in Python between ops is python-overhead's (or a sync's: printing a
    # tensor runs ops of its own), whatever op leads the little op time there is.
    python_share = wp.pct(wp.per_step(w, "python_s"), step_s)
    if share < t.profile_hot_op_pct or python_share >= t.profile_python_alert_pct:
        return None
    # Thousands of calls of a few microseconds each are dispatch, not arithmetic: that step
    # is python-overhead's, and making the op itself faster would not help.
    if (top["self_s"] or 0.0) / max(top["count"] or 1, 1) < TINY_CALL_S:
        return None
    ops_total = sum((o["self_s"] or 0.0) for o in steady) / n
    covering, acc = [], 0.0
    for op in steady:
        if acc >= ops_total * t.profile_ops_cover_pct / 100 or len(covering) >= 10:
            break
        acc += (op["self_s"] or 0.0) / n
        covering.append(op)
    evidence = wp.window_evidence(w) + [
        Evidence(f"{_label(op)}", wp.pct((op["self_s"] or 0.0) / n, step_s), "% of the step")
        for op in covering
    ]
    evidence.append(Evidence(f"{_label(top)} per step", round(top_s, 6), "s"))
    fp32 = "float" in (top.get("input_types") or "") and "BFloat16" not in (
        top.get("input_types") or ""
    )
    if MATMUL_OPS.match(top["name"]):
        fix = (
            f"`{_label(top)}` is the model's own arithmetic: on this CPU, bf16 autocast "
            "(`with torch.autocast('cpu', dtype=torch.bfloat16):` around the forward) speeds it "
            "where the CPU has AMX or AVX-512 BF16; on a tensor-core GPU, AMP (bf16) or TF32 "
            "(`torch.set_float32_matmul_precision('high')`). Otherwise a smaller shape."
        )
        settings: dict[str, Any] = {"autocast_dtype": "bfloat16"} if fp32 else {}
    elif ELEMENTWISE_OPS.match(top["name"]):
        fix = "Fuse the elementwise chain with `model = torch.compile(model)`."
        settings = {"torch_compile": True}
    else:
        fix = f"Look at what calls `{top['name']}` on these shapes: it is most of the step."
        settings = {}
    return share, Finding(
        id=ID,
        severity="info",
        title=f"One op takes {share:g} % of the profiled step: {_label(top)}",
        evidence=evidence,
        recommendation=fix,
        expected_effect=(
            f"A faster `{top['name']}` saves {wp.at_most(top_s, step_s)} (its whole time); the "
            "gain of a precision change is measured by profiling the same steps again."
        ),
        confidence=0.6,
        settings=settings,
    )


def _gpu(ctx: DiagnosisContext, w: WindowProfile) -> tuple[float, Finding] | None:
    t = ctx.thresholds
    n = len(w.steps)
    busy = wp.per_step(w, "gpu_busy_s")
    span = wp.gpu_span(w)
    if not w.kernels or not n or span <= 0 or wp.pct(busy, span) < t.profile_gpu_saturated_pct:
        return None
    top = w.kernels[0]
    top_s = (top["total_s"] or 0.0) / n
    share = wp.pct(top_s, busy)
    if share < t.profile_hot_op_pct:
        return None
    major = (w.trace or {}).get("compute_major")
    fp32_matmul = [
        o
        for o in w.ops
        if MATMUL_OPS.match(o["name"]) and '"float"' in (o.get("input_types") or "")
    ]
    evidence = (
        wp.window_evidence(w)
        + [
            Evidence("GPU busy", wp.pct(busy, span), "% of its span"),
            Evidence(f"kernel {top['name'][:120]}", share, "% of GPU busy time"),
            Evidence("kernel time per step", round(top_s, 6), "s"),
        ]
        + [Evidence(f"fp32 op {_label(o)}", o["count"], "calls") for o in fp32_matmul[:3]]
    )
    settings: dict[str, Any] = {}
    if MATMUL_KERNELS.search(top["name"]) and fp32_matmul and major is not None and major >= 7:
        fix = (
            "The GPU is busy in fp32 matmuls/convolutions on a tensor-core GPU (compute "
            f"capability {major}): `torch.autocast('cuda', dtype=torch.bfloat16)` around the "
            "forward (AMP)"
            + (
                ", or TF32 for fp32: `torch.set_float32_matmul_precision('high')`."
                if major >= 8
                else "."
            )
        )
        settings = {"autocast_dtype": "bfloat16", "float32_matmul_precision": "high"}
    elif ELEMENTWISE_KERNELS.search(top["name"]):
        fix = "Fuse the elementwise kernels with `model = torch.compile(model)`."
        settings = {"torch_compile": True}
    else:
        fix = "This kernel is most of the GPU's work: a smaller shape or a faster algorithm for it."
    step_s = wp.per_step(w, "dur_s")
    return share, Finding(
        id=ID,
        severity="info",
        title=f"One kernel takes {share:g} % of the GPU's busy time in the profiled steps",
        evidence=evidence,
        recommendation=fix,
        expected_effect=(
            f"A faster kernel saves {wp.at_most(min(top_s, step_s), step_s)} (its whole time); the "
            "gain of a precision change is measured by profiling the same steps again."
        ),
        confidence=0.6,
        settings=settings,
    )
