"""no-mixed-precision: the job trains on a GPU with fast fp16/bf16 (tensor cores, compute
capability 7.0+) and no step ran under autocast."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "no-mixed-precision"


def check(ctx: DiagnosisContext) -> list[Finding]:
    if not ctx.steps_use_cuda:
        return []  # no step reserved CUDA memory: none is kept below
    steps = [s for s in ctx.steady_steps if s["cuda_reserved"]]
    if len(steps) < 3 or not ctx.job_gpus:
        return []
    if any(s["autocast_dtype"] for s in steps):
        return []
    capabilities = {}
    for index in ctx.job_gpus:
        cc = _capability(ctx.gpu_infos.get(index, {}).get("compute_capability"))
        if cc is not None:
            capabilities[index] = cc
    if not capabilities or min(capabilities.values()) < (7, 0):
        return []
    index = min(capabilities, key=capabilities.get)
    name = ctx.gpu_infos[index].get("name", f"GPU {index}")
    bf16 = capabilities[index] >= (8, 0)
    dtype = "bfloat16" if bf16 else "float16"
    code = f'with torch.autocast("cuda", dtype=torch.{dtype}):'
    rec = f"Run the forward pass and the loss under `{code}`"
    rec += (
        " (bf16 needs no loss scaling)."
        if bf16
        else " and scale the loss with torch.amp.GradScaler (fp16 needs it)."
    )
    settings: dict[str, object] = {"autocast_dtype": dtype}
    if not bf16:
        settings["grad_scaler"] = True
    cc_text = ".".join(map(str, capabilities[index]))
    return [
        Finding(
            id=ID,
            severity="info",
            title=f"Training in float32 on a {name} (compute capability {cc_text}) with fast {dtype}",
            evidence=[
                Evidence(
                    "steps under autocast", 0, "steps", steps[0]["t_start"], steps[-1]["t_end"]
                ),
                Evidence("steps measured", len(steps), "steps"),
                Evidence(f"GPU {index} compute capability", cc_text, ""),
            ],
            recommendation=rec,
            expected_effect=(
                "Matrix multiplies and convolutions run on tensor cores (often 1.5-3x faster "
                "steps) and activation memory drops by roughly 40-50 %."
            ),
            confidence=0.7,
            settings=settings,
        )
    ]


def _capability(text: object) -> tuple[int, int] | None:
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, AttributeError):
        return None
