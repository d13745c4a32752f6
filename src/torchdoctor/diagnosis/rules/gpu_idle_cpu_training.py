"""gpu-idle-cpu-training: the job trains on the CPU while an NVIDIA GPU sits free."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.series import mean
from torchdoctor.units import fmt_bytes

ID = "gpu-idle-cpu-training"
FREE_UTILIZATION_PCT = 10.0


def check(ctx: DiagnosisContext) -> list[Finding]:
    if ctx.step_summary is None or ctx.uses_gpu or not ctx.gpu_infos:
        return []
    devices = ctx.param_devices
    if devices and any(not d.startswith("cpu") for d in devices):
        return []
    device = devices[0] if devices else None
    candidates = []
    for index in ctx.gpu_infos:
        util = mean([v for _, v in ctx.gpu_series(index, "utilization_gpu")])
        samples = ctx.gpu_samples.get(index, [])
        free = [
            s["memory_total"] - s["memory_used"]
            for s in samples
            if s["memory_total"] and s["memory_used"] is not None
        ]
        if util is None or util > FREE_UTILIZATION_PCT or not free:
            continue
        candidates.append((min(free), index, util))
    if not candidates:
        return []
    free, index, util = max(candidates)
    name = ctx.gpu_infos[index].get("name", f"GPU {index}")
    return [
        Finding(
            id=ID,
            severity="warning",
            title=f"The job trains on the CPU while GPU {index} ({name}) is free",
            evidence=[
                Evidence("device of the parameters", str(device or "cpu"), ""),
                Evidence(f"GPU {index} busy", round(util, 1), "%", ctx.t_start, ctx.t_end),
                Evidence(f"GPU {index} free memory", free, "B", ctx.t_start, ctx.t_end),
                Evidence(
                    "steps per second on the CPU", round(ctx.step_summary.steps_per_s, 2), "steps/s"
                ),
            ],
            recommendation=(
                f'model.to("cuda:{index}") and move each batch with .to("cuda:{index}", '
                f"non_blocking=True); {fmt_bytes(free)} of GPU memory is free. Check that the "
                "installed torch is a CUDA build (torch.cuda.is_available())."
            ),
            expected_effect="Typically an order of magnitude faster steps for dense models.",
            confidence=0.8 if device is not None else 0.65,
            settings={"device": f"cuda:{index}"},
        )
    ]
