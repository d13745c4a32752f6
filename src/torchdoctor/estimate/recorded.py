"""What a recording says about the job's training step, for ``torchdoctor estimate --from``.

The estimator re-runs the recorded loop on the recorded GPU: the GPU's name, memory and
compute capability come from the recording's GPU information (NVML's, at the start of the
run), the batch size from the cuda-oom event (the agent's step counter) or the last recorded
step, the precision from autocast and the parameters' dtypes, the optimizer from its class.
What the recording does not say stays None, and the estimator's default is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchdoctor.estimate.profiles import DEFAULT_COMPUTE_CAPABILITY, GpuProfile
from torchdoctor.recording.reader import Recording
from torchdoctor.recording.steps import decode_json

# The agent records an optimizer by its class (torch.optim.adamw.AdamW); these are the ones
# the estimator models. SGD's momentum is not recorded, so it is taken as plain SGD.
OPTIMIZER_CLASSES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd"}
AUTOCAST_PRECISIONS = {"bfloat16": "bf16-mixed", "float16": "fp16-mixed"}


@dataclass
class RecordedStep:
    """The recorded job's step as the estimator needs it; None: not recorded."""

    gpu: GpuProfile | None
    batch_size: int | None
    precision: str | None
    optimizer: str | None
    optimizer_impl: str | None
    oom: dict[str, Any] | None  # the last cuda-oom event's detail
    notes: list[str] = field(default_factory=list)  # what was read how, for the user


def read_recorded_step(rec: Recording) -> RecordedStep:
    settings: dict[str, Any] = {}
    for row in rec.rows("settings"):
        value = decode_json(row["value"])
        if value is not None:
            settings.setdefault(row["key"], value)  # the first process that has it
    ooms = [e for e in rec.rows("events") if e["kind"] == "cuda-oom"]
    oom = (decode_json(ooms[-1]["detail"]) or {}) if ooms else None
    steps = rec.steps()
    notes: list[str] = []
    return RecordedStep(
        gpu=_gpu(rec.meta, oom, settings),
        batch_size=_batch(oom, steps),
        precision=_precision(settings, steps),
        optimizer=_optimizer(settings, notes),
        optimizer_impl=_optimizer_impl(settings),
        oom=oom,
        notes=notes,
    )


def _gpu(meta: dict[str, Any], oom: dict | None, settings: dict[str, Any]) -> GpuProfile | None:
    status = meta.get("gpus") or {}
    infos = {int(g["index"]): g for g in status.get("gpus") or [] if g.get("memory_total")}
    if not status.get("available") or not infos:
        return None
    # The OOM names its device; else the device the parameters were on.
    index = oom.get("device") if oom else None
    if index is None:
        devices = [d for d in settings.get("params.devices") or [] if d.startswith("cuda")]
        index = int(devices[0].partition(":")[2] or 0) if devices else None
    info = infos.get(int(index)) if index is not None else None
    info = info or infos[min(infos)]
    cc = info.get("compute_capability")
    capability = tuple(int(x) for x in cc.split(".")) if cc else DEFAULT_COMPUTE_CAPABILITY
    return GpuProfile(str(info.get("name") or "GPU"), int(info["memory_total"]), capability)


def _batch(oom: dict | None, steps: list[dict[str, Any]]) -> int | None:
    if oom and oom.get("batch_size"):
        return int(oom["batch_size"])
    sizes = [s["batch_size"] for s in steps if s.get("batch_size")]
    return int(sizes[-1]) if sizes else None


def _precision(settings: dict[str, Any], steps: list[dict[str, Any]]) -> str | None:
    autocast = settings.get("amp.autocast") or next(
        (s["autocast_dtype"] for s in reversed(steps) if s.get("autocast_dtype")), None
    )
    if autocast:
        return AUTOCAST_PRECISIONS.get(str(autocast).removeprefix("torch."))
    dtypes = settings.get("params.dtypes")
    if dtypes == ["bfloat16"]:
        return "bf16"
    return "fp32" if dtypes or "optimizer.class" in settings else None


def _optimizer(settings: dict[str, Any], notes: list[str]) -> str | None:
    qualname = settings.get("optimizer.class")
    if not qualname:
        return None
    name = str(qualname).rsplit(".", 1)[-1]
    if name not in OPTIMIZER_CLASSES:
        notes.append(f"the recorded optimizer {qualname} is not modelled: give --optimizer")
        return None
    if name == "SGD":
        notes.append("SGD's momentum is not recorded: estimated without (--optimizer sgd-momentum)")
    return OPTIMIZER_CLASSES[name]


def _optimizer_impl(settings: dict[str, Any]) -> str | None:
    if settings.get("optimizer.fused"):
        return "fused"
    foreach = settings.get("optimizer.foreach")
    if foreach is None:
        return None
    return "foreach" if foreach else "for-loop"
