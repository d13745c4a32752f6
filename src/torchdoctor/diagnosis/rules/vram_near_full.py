"""vram-near-full: GPU memory in use above the table's alert (90 %), sustained, or a CUDA OOM.

The fix is the batch size that lands memory in the middle of the best range (60-85 %),
computed from the job's own per-step allocator figures (see ``_vram``).
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import span_evidence
from torchdoctor.diagnosis.rules._vram import memory_pct_series, vram_model
from torchdoctor.units import fmt_bytes

ID = "vram-near-full"


def check(ctx: DiagnosisContext) -> list[Finding]:
    th = ctx.thresholds
    ooms = ctx.events_of("cuda-oom")
    findings = []
    for index in ctx.job_gpus:
        span = ctx.sustained(memory_pct_series(ctx, index), th.gpu_memory_alert_pct)
        if span is None:
            continue  # an OOM without sustained pressure is cuda-oom's to explain
        target = (th.gpu_memory_best_low_pct + th.gpu_memory_best_high_pct) / 2
        model = vram_model(ctx, index)
        evidence = []
        if span is not None:
            evidence += [
                span_evidence(f"GPU {index} memory in use", span, "%"),
                Evidence(
                    f"GPU {index} memory peak", round(span.peak, 1), "%", span.t_start, span.t_end
                ),
            ]
        if ooms:
            evidence.append(
                Evidence(
                    "CUDA out-of-memory errors", len(ooms), "errors", ooms[0]["t"], ooms[-1]["t"]
                )
            )
        settings: dict[str, object] = {}
        if model is not None:
            batch = (
                min(model.batch_for(target), model.batch_size - 1) if model.batch_size > 1 else 1
            )
            predicted = model.percent_at(batch)
            evidence += [
                Evidence("batch size", model.batch_size, "samples"),
                Evidence("activation memory per sample", round(model.per_sample), "B"),
                Evidence(
                    "memory independent of the batch (weights, grads, optimizer)",
                    round(model.fixed),
                    "B",
                ),
            ]
            settings["batch_size"] = batch
            rec = (
                f"batch_size={batch} (from {model.batch_size}): each sample costs "
                f"{fmt_bytes(model.per_sample)} of activations on top of {fmt_bytes(model.fixed)} "
                f"for weights, gradients and optimizer state, so {batch} lands at about "
                f"{predicted:.0f} % of the GPU's {fmt_bytes(model.total)}."
            )
            if not any(s["autocast_dtype"] for s in ctx.steady_steps):
                rec += (
                    " Mixed precision (torch.autocast) cuts activation memory by roughly 40-50 % "
                    "and may let the batch size stay."
                )
            rec += " Keep the effective batch with gradient accumulation over "
            rec += f"{-(-model.batch_size // batch)} micro-batches if the optimisation needs it."
            expected = f"GPU memory at about {predicted:.0f} %, in the best range: no OOM, no allocator retries."
        else:
            rec = (
                "Lower the batch size, or use mixed precision (torch.autocast), gradient "
                "checkpointing or gradient accumulation; the recording has no per-step CUDA "
                "memory figures to size the batch from."
            )
            expected = "GPU memory back in the best range."
        label = f"{span.mean:.0f} % in use" if span is not None else "out of memory"
        findings.append(
            Finding(
                id=ID,
                severity="critical"
                if ooms or (span is not None and span.peak >= 98)
                else "warning",
                title=f"GPU {index} memory is near full ({label})",
                evidence=evidence,
                recommendation=rec,
                expected_effect=expected,
                confidence=0.85 if model is not None else 0.6,
                settings=settings,
            )
        )
    return findings
