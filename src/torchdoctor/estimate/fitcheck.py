"""One loaded model and its target, estimated set-up after set-up: the estimate itself, the
changes that would make a step fit, and the peak under the other training loops."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.errors import ParameterError, UserError
from torchdoctor.estimate.loops import FREES_OUTPUT, HAND_WRITTEN, HF_TRAINER, LIGHTNING
from torchdoctor.estimate.result import Alternative, Baselines, Estimate, LoopPeak, ModuleActivation
from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.workload import Workload
from torchdoctor.units import fmt_bytes

DEFAULT_MARGIN = 0.05
_OPTIMIZER_FACTOR = {"sgd": 1.0, "sgd-momentum": 1.5, "adam": 2.0, "adamw": 2.0}
_BREAKDOWN_ORDER = (
    "parameters",
    "gradients",
    "optimizer state",
    "inputs",
    "activations",
    "temporaries",
    "kernel scratch",
    "workspaces",
)
# Fall back to a real CPU run only when the model states surely fit in a fraction of the RAM.
_REAL_RUN_RAM_FRACTION = 0.25


@dataclass(frozen=True)
class FitCheck:
    """A loaded model and its target: estimates one training setup after another (what-ifs and
    the batch search change only the setup)."""

    workload: Workload
    target: Target
    capacity: int | None  # the memory to fit, if one was given
    margin: float = DEFAULT_MARGIN
    fallback: bool = True

    def estimate(
        self,
        setup: TrainingSetup,
        memory_snapshot: str | Path | None = None,
        *,
        replace_snapshot: bool = True,
    ) -> Estimate:
        return estimate_workload(
            self.workload,
            setup,
            self.target,
            self.margin,
            self.fallback,
            self.capacity,
            memory_snapshot,
            replace_snapshot=replace_snapshot,
        )


def estimate_workload(
    workload: Workload,
    setup: TrainingSetup,
    target: Target,
    margin: float = DEFAULT_MARGIN,
    fallback: bool = True,
    capacity: int | None = None,
    memory_snapshot: str | Path | None = None,
    *,
    replace_snapshot: bool = True,
) -> Estimate:
    """Trace ``workload`` and turn the timeline into an :class:`Estimate`.

    ``memory_snapshot`` replaces an existing regular file only with ``replace_snapshot`` (the
    library's default; the CLI asks for --force), never a recording, a folder or a device."""
    from torchdoctor.estimate.analysis import activations_by_module, cpu_peak, cuda_peak, phase_at

    if not 0.0 <= margin < 1.0:
        raise ParameterError(f"{{}} must be a fraction between 0 and 1, not {margin}", "margin")
    started = time.perf_counter()
    trace, method, notes = _trace(workload, setup, target, fallback)
    limit = int(capacity * (1.0 - margin)) if capacity is not None else None
    breakdown: dict[str, int]
    tensor_peak = None
    if target.is_cuda:
        assert target.gpu is not None
        peak = cuda_peak(trace, target.gpu)
        if limit is not None and peak.total > limit:
            # The real allocator frees its cache and retries before it gives up: replay with
            # the limit to see whether the step survives that.
            limited = cuda_peak(trace, target.gpu, capacity=max(limit - peak.context, 0))
            fits = not limited.out_of_memory
            if fits:
                peak = limited
        else:
            fits = limit is not None
        breakdown = _ordered(peak.by_category)
        breakdown["allocator overhead"] = peak.reserved - peak.allocated
        breakdown["CUDA context"] = peak.context
        reserved, total = peak.reserved, peak.total
        backends = ", ".join(f"{n} x {b}" for b, n in sorted(trace.attention_backends.items()))
        if backends:
            notes.append(f"attention on CUDA: {backends} (calls traced)")
        if trace.uses_rnn:
            notes.append(
                "recurrent layers use cuDNN on CUDA, whose reserve buffers differ from the CPU "
                "kernels traced here: the estimate for them is approximate"
            )
    else:
        peak = cpu_peak(trace)
        tensor_peak = cpu_peak(trace, scratch=False).allocated
        breakdown = _ordered(peak.by_category)
        reserved = total = None
        fits = peak.allocated <= limit if limit is not None else None
    if memory_snapshot is not None:
        from torchdoctor.estimate.snapshot import write_memory_snapshot

        written = write_memory_snapshot(trace, target.gpu, memory_snapshot, force=replace_snapshot)
        notes.append(
            f"memory snapshot written to {written}: open it at https://pytorch.org/memory_viz"
        )
    where = phase_at(trace, peak.event)
    activations = activations_by_module(trace)
    notes.extend(trace.notes)
    return Estimate(
        model=workload.name,
        setup=setup,
        target=target,
        parameter_count=trace.parameter_count,
        peak_allocated=peak.allocated,
        tensor_peak=tensor_peak,
        peak_reserved=reserved,
        total=total,
        breakdown=breakdown,
        peak_phase=where.phase,
        peak_step=where.step,
        activations=activations.total,
        top_modules=[
            ModuleActivation(m.module, m.type, m.bytes, m.count) for m in activations.modules
        ],
        baselines=_baselines(trace.parameter_count, trace.parameter_bytes, setup),
        method=method,
        seconds=time.perf_counter() - started,
        gpu_memory=capacity,
        margin=margin,
        fits=fits if capacity is not None else None,
        notes=notes,
        model_kind=trace.model_kind,
        loop_reason=_loop_reason(workload, setup),
    )


def _loop_reason(workload: Workload, setup: TrainingSetup) -> str:
    """Why the estimate's loop, where it is the one assumed for the spec (not asked for)."""
    default = workload.default_loop
    return default[1] if default is not None and default[0] == setup.loop else ""


def _trace(workload: Workload, setup: TrainingSetup, target: Target, fallback: bool) -> tuple:
    from torchdoctor.estimate.trace import DataDependentOp, trace_step

    try:
        return trace_step(workload, setup, target), "traced under fake tensors", []
    except DataDependentOp as exc:
        problem = exc.describe()
        if not fallback:
            raise UserError(
                f"{problem}: fake tensors cannot trace it (a real CPU run is off)"
            ) from None
        available = _available_ram()
        if exc.parameter_bytes * 4 > available * _REAL_RUN_RAM_FRACTION:
            raise UserError(
                f"{problem}: fake tensors cannot trace it, and a real CPU run would need more "
                f"than the {fmt_bytes(available)} of RAM available; make the op "
                "value-independent (e.g. keep the tensor instead of calling .item())"
            ) from None
        trace = trace_step(workload, setup, target, real=True)
        note = (
            f"{problem}, which fake tensors cannot trace: measured with a real CPU run instead "
            f"({trace.seconds:.1f} s)"
        )
        return trace, "real CPU run (fallback)", [note]


def _available_ram() -> int:
    from torchdoctor.sampling.hostinfo import available_ram

    return available_ram()


def _ordered(by_category: dict[str, int]) -> dict[str, int]:
    ordered = {name: by_category.get(name, 0) for name in _BREAKDOWN_ORDER}
    for name, value in by_category.items():
        ordered.setdefault(name, value)
    return ordered


def _baselines(parameters: int, parameter_bytes: int, setup: TrainingSetup) -> Baselines:
    if setup.inference:
        return Baselines(parameters * 4, parameter_bytes)
    naive = int(parameters * 4 * 2 * _OPTIMIZER_FACTOR[setup.optimizer])
    return Baselines(naive, parameter_bytes * 4)


def other_loops(check: FitCheck, setup: TrainingSetup, result: Estimate) -> list[LoopPeak]:
    """The peak of the same step under the other loops this model could be trained with:
    holding or freeing the output always; the HF Trainer for transformers models (it needs
    a model that computes its loss from labels); Lightning for LightningModules or when asked.
    """
    candidates = [HAND_WRITTEN, FREES_OUTPUT]
    if result.model_kind == "hf":
        candidates.append(HF_TRAINER)
    if result.model_kind == "lightning" or setup.loop == LIGHTNING:
        candidates.append(LIGHTNING)
    found = []
    for name in candidates:
        if name == setup.loop:
            continue
        other = check.estimate(setup.with_(loop=name))
        change = other.headline_bytes - result.headline_bytes
        found.append(LoopPeak(name, other.headline_bytes, change))
    return found


def alternatives(check: FitCheck, setup: TrainingSetup) -> list[Alternative]:
    """Changes that could make a step fit, each re-estimated rather than guessed."""
    options: list[tuple[str, TrainingSetup]] = []
    if setup.precision == "fp32":
        options.append(
            ("bf16 mixed precision (--precision bf16-mixed)", setup.with_(precision="bf16-mixed"))
        )
    if not setup.checkpointing and not setup.inference:
        options.append(
            ("activation checkpointing (--checkpointing)", setup.with_(checkpointing=True))
        )
    if setup.optimizer in ("adam", "adamw") and setup.optimizer_impl_used() != "fused":
        options.append(
            (
                f"fused {setup.optimizer} (--optimizer-impl fused)",
                setup.with_(optimizer_impl="fused"),
            )
        )
        options.append(
            ("SGD with momentum instead of Adam (--optimizer sgd-momentum)",
             setup.with_(optimizer="sgd-momentum", optimizer_impl="auto")),
        )  # fmt: skip
    combined = setup
    if setup.precision == "fp32":
        combined = combined.with_(precision="bf16-mixed")
    if not setup.inference:
        combined = combined.with_(checkpointing=True)
    found = [Alternative(change, check.estimate(changed)) for change, changed in options]
    if setup.batch_size > 1 and not setup.inference:
        found.extend(_accumulation(check, setup))
    if combined != setup and all(not a.estimate.fits for a in found):
        label = "bf16 mixed precision with activation checkpointing"
        if setup.batch_size > 1:
            combined = combined.with_(
                batch_size=1, grad_accumulation=setup.batch_size * setup.grad_accumulation
            )
            label += f", {setup.batch_size} micro-batches of 1"
        found.append(Alternative(label, check.estimate(combined)))
    return found


def _accumulation(check: FitCheck, setup: TrainingSetup) -> list[Alternative]:
    """The largest micro-batch (dividing the batch) that fits, with accumulation to keep the
    effective batch."""
    batch = setup.batch_size
    last = None
    for micro in sorted({d for d in range(1, batch) if batch % d == 0}, reverse=True):
        steps = batch // micro
        changed = setup.with_(batch_size=micro, grad_accumulation=setup.grad_accumulation * steps)
        result = check.estimate(changed)
        last = Alternative(
            f"gradient accumulation: {steps} micro-batches of {micro} (--batch {micro} "
            f"--grad-accumulation {steps})",
            result,
        )
        if result.fits:
            return [last]
    return [last] if last is not None else []
