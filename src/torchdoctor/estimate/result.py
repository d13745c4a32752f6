"""The estimate as plain data, and its JSON form (documented in the README)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchdoctor.estimate.setup import Target, TrainingSetup

JSON_VERSION = 1


@dataclass
class ModuleActivation:
    module: str  # repeated blocks grouped: "blocks.*.attn"
    type: str
    bytes: int
    count: int = 1  # how many modules the group holds


@dataclass
class Baselines:
    """What the usual rules of thumb would say, for comparison."""

    naive_formula_bytes: int  # params x 4 B x 2 (param + grad) x optimizer factor
    params_only_bytes: int  # accelerate estimate-memory: 4 x parameter bytes for Adam training


@dataclass
class LoopPeak:
    """The peak of the same step under another training loop."""

    loop: str
    bytes: int  # headline bytes: nvidia-smi's total on CUDA, the live peak on the CPU
    change: int  # bytes - the estimate's headline bytes

    def to_dict(self) -> dict[str, Any]:
        return {"loop": self.loop, "bytes": self.bytes, "change_bytes": self.change}


@dataclass
class Estimate:
    """Peak memory of a training step on a target, with what makes it up."""

    model: str
    setup: TrainingSetup
    target: Target
    parameter_count: int
    peak_allocated: int
    tensor_peak: int | None  # CPU: peak of live tensor bytes alone, without kernel scratch
    peak_reserved: int | None
    total: int | None  # nvidia-smi's view: reserved + CUDA context (None on the CPU)
    breakdown: dict[str, int]
    peak_phase: str
    peak_step: int
    activations: int
    top_modules: list[ModuleActivation]
    baselines: Baselines
    method: str
    seconds: float
    gpu_memory: int | None = None
    margin: float = 0.0
    fits: bool | None = None
    notes: list[str] = field(default_factory=list)
    model_kind: str = ""  # "hf", "lightning" or "" (see Trace.model_kind)
    other_loops: list[LoopPeak] = field(default_factory=list)  # when asked for
    loop_reason: str = ""  # why this loop, when it was not asked for (api._default_loop)

    @property
    def headline_bytes(self) -> int:
        """What must fit: nvidia-smi's total on CUDA, the live peak on the CPU."""
        return self.total if self.total is not None else self.peak_allocated

    def to_dict(self) -> dict[str, Any]:
        gpu = self.target.gpu
        return {
            "version": JSON_VERSION,
            "model": self.model,
            "setup": asdict(self.setup),
            "loop": self.setup.loop,
            "loop_reason": self.loop_reason or None,
            "other_loops": [other.to_dict() for other in self.other_loops],
            "target": {
                "device": self.target.device,
                "gpu": gpu.name if gpu else None,
                "gpu_memory_bytes": gpu.memory_bytes if gpu else None,
                "compute_capability": ".".join(map(str, gpu.compute_capability)) if gpu else None,
            },
            "parameters": self.parameter_count,
            "peak_allocated_bytes": self.peak_allocated,
            "tensor_peak_bytes": self.tensor_peak,
            "peak_reserved_bytes": self.peak_reserved,
            "total_bytes": self.total,
            "breakdown_bytes": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "peak_step": self.peak_step + 1,
            "activations_bytes": self.activations,
            "top_modules": [asdict(m) for m in self.top_modules],
            "baselines": asdict(self.baselines),
            "fits": self.fits,
            "margin": self.margin,
            "method": self.method,
            "seconds": round(self.seconds, 3),
            "notes": list(self.notes),
        }


@dataclass
class Alternative:
    """A change to the set-up, re-estimated."""

    change: str
    estimate: Estimate

    def to_dict(self) -> dict[str, Any]:
        return {
            "change": self.change,
            "fits": self.estimate.fits,
            "total_bytes": self.estimate.headline_bytes,
            "setup": asdict(self.estimate.setup),
        }


@dataclass
class MaxBatch:
    """The largest batch that fits the target with the margin, and how it was found."""

    batch_size: int  # 0 when not even batch 1 fits
    estimate: Estimate | None  # at batch_size (or at batch 1 when nothing fits)
    probes: list[tuple[int, int, bool]]  # (batch, bytes, fits) in search order
    capacity: int
    alternatives: list[Alternative] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": JSON_VERSION,
            "max_batch": self.batch_size,
            "capacity_bytes": self.capacity,
            "estimate": self.estimate.to_dict() if self.estimate else None,
            "probes": [{"batch": b, "bytes": n, "fits": f} for b, n, f in self.probes],
            "alternatives": [a.to_dict() for a in self.alternatives],
            "seconds": round(self.seconds, 3),
        }
