"""cuda-oom: the job ran out of CUDA memory; what held it and what will fit.

The agent records the moment (instrument/agent/cuda.py): the step, the phase, the requested
size and the caching allocator's statistics. Memory at that moment is split into parameters
(``params.bytes``), gradients (as large as the parameters once backward has run), optimizer
state (Adam's two moments: twice the parameters, once the first step allocated them), the
batch's activations (the rest of what was allocated) and fragmentation (reserved but not
allocated: cached blocks too small for the request). When the job ran with
``--memory-history`` the agent's snapshot at the OOM measures that split instead (what was
live at the peak by phase and by source line, diagnosis.cuda_memory), and the title names the
line that held the most.

The fix is sized from the allocator state at the OOM and the per-step memory recorded before
it: the largest micro-batch that divides the batch and fits within the best range of the GPU,
with the gradient accumulation that keeps the same global batch. A recording does not hold the
model, so the finding says how the estimator checks the fix where the model can be built
(``torchdoctor estimate --from RECORDING SPEC`` re-estimates the recorded loop on the
recorded GPU, for the recorded batch and for this fix).
"""

from __future__ import annotations

from typing import Any

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.cuda_memory import (
    ACTIVATIONS,
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    phase_split,
)
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules import cuda_fragmentation
from torchdoctor.diagnosis.rules._memory_peak import peak_evidence, snapshots, top_line
from torchdoctor.units import fmt_bytes

ID = "cuda-oom"
CAUSES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS)  # what a cause may be named
AFTER_OTHERS = True  # reads the cuda-fragmentation finding so the two say one thing
STATE_FACTORS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1}
STATE_NOTE = "two moments per parameter"
BF16_ACTIVATIONS = 0.55  # autocast keeps roughly half the activation bytes (BRIEF section 3)
SIZED_FROM = (
    "sized from the allocator's state at the OOM and the per-step CUDA memory the job recorded; "
    "check it with the estimator: torchdoctor estimate --from {recording} SPEC"
)
# The bf16 alternative's wording: `estimate --from` re-estimates it when the finding offers it.
BF16_ALTERNATIVE = "bf16 autocast at batch"


def sized_from(ctx: DiagnosisContext) -> str:
    """How the fix was sized, and the command that checks it on this recording."""
    path = getattr(ctx.recording, "path", None)
    return SIZED_FROM.format(recording=path or "RECORDING")


def check(ctx: DiagnosisContext) -> list[Finding]:
    events = ctx.events_of("cuda-oom")
    if not events:
        return []
    event = events[-1]
    d: dict[str, Any] = event["detail"] or {}
    allocated = d.get("allocated_bytes")
    if allocated is None:
        return [_unmeasured(ctx, events, d)]
    reserved = d.get("reserved_bytes") or allocated
    requested = d.get("requested_bytes") or 0
    phase = d.get("phase") or "forward"
    step = d.get("step") or 0
    total = _capacity(ctx, d)
    snapshot = next(
        (s for s in snapshots(ctx, "oom") if s.pid == event["pid"] and s.t == event["t"]), None
    )
    measured = snapshot.peak if snapshot is not None else None
    # A snapshot measures the split; without one it is inferred from the parameters' size.
    parts = dict(measured.by_phase) if measured is not None else _parts(ctx, allocated, phase, step)
    fragmentation = max(0, reserved - allocated)
    largest = d.get("largest_free_block_bytes")
    known = {k: v for k, v in parts.items() if k in CAUSES}
    if fragmentation >= requested > 0 and (largest is None or largest < requested):
        cause = "fragmentation"
    elif phase == "optimizer" and parts.get("optimizer state"):
        cause = "optimizer state"
    else:
        cause = max(known, key=lambda k: known[k]) if known else "activations"
    evidence = [
        Evidence("phase", f"{phase} of step {step}", ""),
        Evidence("requested", requested, "B"),
        Evidence("allocated by PyTorch", allocated, "B"),
        Evidence("reserved by the caching allocator", reserved, "B"),
        Evidence("fragmentation (reserved - allocated)", fragmentation, "B"),
    ]
    if largest is not None:
        evidence.append(Evidence("largest free cached block", largest, "B"))
    if snapshot is not None:
        evidence += peak_evidence(snapshot)
    else:
        for name, value in parts.items():
            evidence.append(Evidence(name, value, "B"))
    if total:
        evidence.append(Evidence("GPU memory", total, "B"))
    # What the device held beyond PyTorch's reservation (the CUDA context, other processes)
    # stays whatever the batch: it comes off the budget the micro-batch is sized in.
    free = d.get("free_bytes")
    outside = max(0, total - free - reserved) if total and free is not None else 0
    if outside:
        evidence.append(Evidence("outside PyTorch (CUDA context, other processes)", outside, "B"))
    settings: dict[str, Any] = {}
    best = total * ctx.thresholds.gpu_memory_best_high_pct / 100 if total else None
    budget = max(0.0, best - outside) if best is not None else None
    fixed = sum(v for k, v in parts.items() if k != "activations")
    if cause == "fragmentation":
        rec, expected = _fragmentation_fix(ctx, fragmentation, requested, settings)
    elif cause == "activations":
        rec, expected = _batch_fix(ctx, d, parts, fixed, requested, budget, settings)
    elif cause == "optimizer state":
        state = parts["optimizer state"]
        # An 8-bit optimizer keeps a byte per moment instead of four: a quarter of the state.
        light = fixed - state + state / 4 + parts.get("activations", 0)
        fits = budget is not None and light <= budget
        if fits:
            settings["optimizer"] = "bitsandbytes.optim.AdamW8bit"
        rec = (
            f"The optimizer's state ({fmt_bytes(state)}, {STATE_NOTE}) did not fit at its "
            f"first allocation: the step needed at least {fmt_bytes(allocated + requested)}. "
            f"An 8-bit optimizer (bitsandbytes AdamW8bit) keeps a quarter of it: about "
            f"{fmt_bytes(light)} in all, "
            + (
                f"within the {fmt_bytes(budget)} best range"
                if fits
                else "still too much: shard the state across GPUs (FSDP / ZeRO)"
            )
            + f" ({sized_from(ctx)}). AdamW(fused=True) also avoids foreach's per-parameter "
            "temporaries during the step; bf16 weights halve parameters and gradients."
        )
        expected = "The first optimizer step completes; memory settles after it."
    else:
        rec = (
            f"The model's own {cause} ({fmt_bytes(parts[cause])}) fill the GPU: bf16 weights "
            "halve parameters and gradients; sharding (FSDP) splits them across GPUs."
        )
        expected = "The model states leave room for the batch."
    return [
        Finding(
            id=ID,
            severity="critical",
            title=f"CUDA out of memory in the {phase} of step {step}: {cause} held the memory"
            + (f" ({top_line(measured)})" if measured is not None and measured.sites else ""),
            evidence=evidence,
            recommendation=rec,
            expected_effect=expected,
            confidence=0.8 if d.get("source") == "allocator" else 0.7,
            settings=settings,
            details=(
                f"At the peak the memory snapshot shows {phase_split(measured)}."
                if measured is not None
                else ""
            ),
        )
    ]


def _unmeasured(ctx: DiagnosisContext, events: list, d: dict[str, Any]) -> Finding:
    """An OOM recorded without the allocator's figures (an older agent, stats unreadable)."""
    return Finding(
        id=ID,
        severity="critical",
        title=f"CUDA out of memory in step {d.get('step', '?')}",
        evidence=[
            Evidence(
                "CUDA out-of-memory errors", len(events), "errors", events[0]["t"], events[-1]["t"]
            )
        ],
        recommendation=(
            "Lower the batch size and keep the global batch with gradient accumulation, or use "
            "bf16 autocast / activation checkpointing; the OOM was recorded without the "
            "allocator's statistics to size them (record it again with torchdoctor run)."
        ),
        expected_effect="The step fits on the GPU.",
        confidence=0.5,
    )


def _capacity(ctx: DiagnosisContext, d: dict[str, Any]) -> int | None:
    for key in ("total_bytes", "device_limit_bytes"):
        if d.get(key):
            return int(d[key])
    info = ctx.gpu_infos.get(int(d.get("device") or 0)) or {}
    return info.get("memory_total")


def _parts(ctx: DiagnosisContext, allocated: int, phase: str, step: int) -> dict[str, int]:
    params = ctx.setting("params.bytes")
    if not params:
        return {"activations": allocated}
    params = int(params)
    grads = params if (phase != "forward" or step > 0) else 0
    name = str(ctx.setting("optimizer.class") or "").rsplit(".", 1)[-1]
    factor = STATE_FACTORS.get(name, 0)
    state = factor * params if (step > 0 or phase == "optimizer") else 0
    activations = max(0, allocated - params - grads - state)
    parts = {"parameters": params, "gradients": grads, "optimizer state": state}
    parts["activations"] = activations
    return {k: v for k, v in parts.items() if v}


def _fragmentation_fix(ctx, fragmentation: int, requested: int, settings) -> tuple[str, str]:
    expected = (
        f"The {fmt_bytes(fragmentation)} the allocator held free become usable in one piece: "
        f"the {fmt_bytes(requested)} request fits."
    )
    if cuda_fragmentation.expandable_on(ctx):
        return (
            f"{fmt_bytes(fragmentation)} were reserved but free, in blocks smaller than the "
            f"{fmt_bytes(requested)} asked, with expandable segments already on: pad inputs "
            "to a few fixed shapes so freed blocks are reused whole.",
            expected,
        )
    said = any(f.id == cuda_fragmentation.ID for f in ctx.findings)
    settings["env.PYTORCH_CUDA_ALLOC_CONF"] = cuda_fragmentation.FIX
    rec = (
        f"{fmt_bytes(fragmentation)} were reserved but free, in blocks smaller than the "
        f"{fmt_bytes(requested)} asked: the memory was there, not in one piece. "
        + (
            "Apply the cuda-fragmentation fix"
            if said
            else f"Set PYTORCH_CUDA_ALLOC_CONF={cuda_fragmentation.FIX}"
        )
        + " (segments grow in place instead of leaving holes)."
    )
    return rec, expected


def _batch_fix(ctx, d, parts, fixed, requested, budget, settings) -> tuple[str, str]:
    batch = d.get("batch_size") or _recorded_batch(ctx)
    activations = parts.get("activations", 0) + requested  # at least what the step wanted
    if not batch or budget is None or activations <= 0:
        return (
            "Lower the batch size and keep the global batch with gradient accumulation, or use "
            "bf16 autocast / activation checkpointing; the recording lacks the batch size or "
            "the GPU's size to compute them.",
            "The step fits on the GPU.",
        )
    # The OOM came part-way through the step, so what it held is a floor; the steps that
    # fitted before it measured the whole step: their peak above what stays between steps,
    # per sample (vram-near-full's model).
    per_sample = activations / batch
    fitted = [
        s for s in ctx.recent_steps if s["cuda_max_allocated"] and s["cuda_allocated"] is not None
    ]
    rates = [
        (s["cuda_max_allocated"] - s["cuda_allocated"]) / s["batch_size"]
        for s in fitted
        if s["batch_size"]
    ]
    per_sample = max([per_sample, *rates])
    activations = per_sample * batch
    # The caching allocator reserves more than it hands out: size what it will reserve.
    slack = [s["cuda_reserved"] / s["cuda_max_allocated"] for s in fitted if s["cuda_reserved"]]
    ratio = max(1.0, max(slack) if slack else 1.0)
    micro = next(
        (
            m
            for m in range(batch - 1, 0, -1)
            if batch % m == 0 and ratio * (fixed + per_sample * m) <= budget
        ),
        None,
    )
    alternatives = []
    autocast = any(s["autocast_dtype"] for s in ctx.recent_steps)
    bf16_peak = ratio * (fixed + BF16_ACTIVATIONS * activations)
    if not autocast:
        fits = "fits" if bf16_peak <= budget else "does not fit"
        alternatives.append(f"{BF16_ALTERNATIVE} {batch}: about {fmt_bytes(bf16_peak)} ({fits})")
    alternatives.append("activation checkpointing trades recomputation for most of the rest")
    if micro is None:
        return (
            f"Even one sample needs about {fmt_bytes(ratio * (fixed + per_sample))} of the "
            f"{fmt_bytes(budget)} best range; "
            + "; ".join(alternatives)
            + f" ({sized_from(ctx)}).",
            "The step fits on the GPU.",
        )
    steps = batch // micro
    peak = ratio * (fixed + per_sample * micro)
    settings.update({"batch_size": micro, "gradient_accumulation_steps": steps})
    return (
        f"The batch's activations ({fmt_bytes(activations)} at batch {batch}, "
        f"{fmt_bytes(per_sample)} a sample) held the memory. Use micro-batches of {micro} with "
        f"gradient accumulation over {steps} steps (the same global batch of {batch}): "
        f"about {fmt_bytes(peak)}, within the {fmt_bytes(budget)} best range ({sized_from(ctx)}). "
        "Or: " + "; ".join(alternatives) + ".",
        f"Peak CUDA memory about {fmt_bytes(peak)}; same global batch, no OOM.",
    )


def _recorded_batch(ctx: DiagnosisContext) -> int | None:
    sizes = [s["batch_size"] for s in ctx.recent_steps if s["batch_size"]]
    return sizes[-1] if sizes else None
