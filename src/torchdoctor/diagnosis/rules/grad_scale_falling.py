"""grad-scale-falling: a GradScaler keeps skipping optimizer steps, its scale falling each time.

On inf or NaN gradients GradScaler skips ``optimizer.step()`` and multiplies its scale by
``backoff_factor`` (0.5); it grows back (x ``growth_factor``) only after ``growth_interval``
(2000) clean steps. A few skips while the scale calibrates at the start are expected; past the
agent's warm-up (its first 20 scaler steps) a skip rate above ``scaler_skip_alert_pct`` of the
steps means the gradients overflow again and again: those steps train nothing, and the scale
keeps falling. Read from the agent's ``grad-scaler-skip`` events (the last one holds the
counts).
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "grad-scale-falling"
MIN_LATE_SKIPS = 3


def check(ctx: DiagnosisContext) -> list[Finding]:
    events = ctx.events_of("grad-scaler-skip")
    if not events:
        return []
    # One scaler per process: the process that skipped most speaks for the job.
    last: dict[int, dict] = {}
    for e in events:
        if isinstance(e["detail"], dict):
            last[e["pid"]] = e["detail"]
    if not last:
        return []
    d = max(last.values(), key=lambda x: x.get("skipped_after_warmup") or 0)
    late = int(d.get("skipped_after_warmup") or 0)
    calls = int(d.get("calls") or 0)
    warmup = int(d.get("warmup_calls") or 0)
    after = max(calls - warmup, 0)
    # Calls after the last skip event are not counted: steps the job ran since (recorded)
    # bound them; the rate is taken over what the event covers, the conservative side.
    if late < MIN_LATE_SKIPS or not after:
        return []
    pct = late / after * 100
    limit = ctx.thresholds.scaler_skip_alert_pct
    if pct < limit:
        return []
    backoff = d.get("backoff_factor") or 0.5
    growth = d.get("growth_factor") or 2.0
    interval = d.get("growth_interval") or 2000
    skipped = int(d.get("skipped") or 0)
    return [
        Finding(
            id=ID,
            severity="warning",
            title=(
                f"GradScaler skipped {late} of {after} optimizer steps after its warm-up "
                f"({pct:.0f} %): its scale keeps falling"
            ),
            evidence=[
                Evidence("optimizer steps skipped (inf/NaN gradients), all", skipped, "steps"),
                Evidence("skipped after the first scaler steps", late, "steps"),
                Evidence("scaler steps after them", after, "steps"),
                Evidence("skip rate", round(pct, 1), "%"),
                Evidence("scale change per skip", f"x {backoff:g}", ""),
                Evidence("clean steps before it grows", f"{interval} (x {growth:g})", ""),
            ],
            recommendation=(
                "Find what overflows float16: compute the loss in float32 outside autocast "
                "(`with torch.autocast(..., enabled=False): loss = loss_fn(out.float(), y)`), "
                "lower the learning rate or clip gradients after `scaler.unscale_(optimizer)` "
                "(`torch.nn.utils.clip_grad_norm_`); or autocast to torch.bfloat16 (float32's "
                "range, no scaler) where the hardware has it."
            ),
            expected_effect=(
                f"The {pct:.0f} % of steps now thrown away update the model again, and the "
                "scale settles instead of halving on every overflow."
            ),
            confidence=0.8,
            settings={},
        )
    ]
