"""fp16-without-scaler: steps run under float16 autocast and no GradScaler scales the loss.

float16 holds nothing below about 6e-8: small gradients flush to zero (underflow) and those
weights stop learning. ``torch.amp.GradScaler`` multiplies the loss before backward and divides
the gradients before the optimizer step. Read from the steps: their autocast dtype and whether
``GradScaler.scale`` ran in them (bfloat16 needs no scaler and is not flagged).
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "fp16-without-scaler"
MIN_STEPS = 3


def check(ctx: DiagnosisContext) -> list[Finding]:
    if "float16" not in ctx.step_autocast_dtypes:
        return []  # no step under float16 autocast: the rows are not read
    steps = ctx.steps
    fp16 = [s for s in steps if s["autocast_dtype"] == "float16"]
    if len(fp16) < MIN_STEPS or any(s["grad_scaler"] for s in steps):
        return []
    cuda = any(s["cuda_reserved"] for s in fp16)
    device = "cuda" if cuda else "cpu"
    # Steps folded by the writer (recording.compaction) count where every row their process
    # kept, a few a minute throughout, ran under float16 autocast: a loop autocasts all along.
    mixed = {s["pid"] for s in steps if s["autocast_dtype"] != "float16"}
    count = len(fp16) + sum(ctx.folded(p).count for p in {s["pid"] for s in fp16} - mixed)
    return [
        Finding(
            id=ID,
            severity="warning",
            title=f"float16 autocast without a GradScaler in {count} steps",
            evidence=[
                Evidence(
                    "steps under float16 autocast",
                    count,
                    "steps",
                    fp16[0]["t_start"],
                    fp16[-1]["t_end"],
                ),
                Evidence("steps whose loss a GradScaler scaled", 0, "steps"),
                Evidence("device", device, ""),
            ],
            recommendation=(
                f'Scale the loss: `scaler = torch.amp.GradScaler("{device}")` once, then '
                "`scaler.scale(loss).backward()`, `scaler.step(optimizer)`, `scaler.update()` "
                "instead of `loss.backward()` and `optimizer.step()`; or autocast to "
                "torch.bfloat16 where the GPU has it (compute capability 8.0+), which needs no "
                "scaler."
            ),
            expected_effect=(
                "Gradients below float16's range (about 6e-8) are kept instead of flushed to "
                "zero: the weights they belong to keep learning; steps with an overflow are "
                "skipped instead of applied. No change in step time beyond one multiply."
            ),
            confidence=0.85,
            settings={"grad_scaler": True},
        )
    ]
