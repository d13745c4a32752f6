"""The training set-up and the target device of an estimate, as plain data."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchdoctor.errors import ParameterError, UserError
from torchdoctor.estimate.loops import HAND_WRITTEN, find_loop
from torchdoctor.estimate.profiles import GpuProfile

OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")


@dataclass(frozen=True)
class TrainingSetup:
    """One training step as the estimator runs it.

    The step is ``out = model(*inputs)``, ``loss = loss_fn(out, target)``, ``loss.backward()``
    (once per micro-batch with ``grad_accumulation``), ``optimizer.step()``,
    ``optimizer.zero_grad(set_to_none=True)``, held and released as ``loop`` says (see
    :mod:`torchdoctor.estimate.loops`); it runs twice so that optimizer state exists.
    ``inference`` runs one forward pass under ``torch.no_grad()`` instead.

    Invalid values raise a UserError naming the field (the Python parameter of
    :func:`torchdoctor.estimate`); the CLI words it as its flag.
    """

    batch_size: int = 1
    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    precision: str = "fp32"
    grad_accumulation: int = 1
    inference: bool = False
    checkpointing: bool = False
    loop: str = HAND_WRITTEN

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ParameterError(f"{{}} must be at least 1, not {self.batch_size}", "batch_size")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(
                f"unknown optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}"
            )
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise UserError(
                f"unknown optimizer implementation {self.optimizer_impl!r}: "
                f"use one of {', '.join(OPTIMIZER_IMPLS)}"
            )
        if self.precision not in PRECISIONS:
            raise UserError(
                f"unknown precision {self.precision!r}: use one of {', '.join(PRECISIONS)}"
            )
        if self.grad_accumulation < 1:
            raise ParameterError(
                f"{{}} must be at least 1, not {self.grad_accumulation}", "grad_accumulation"
            )
        find_loop(self.loop)

    def with_(self, **changes: object) -> TrainingSetup:
        return replace(self, **changes)

    def optimizer_impl_used(self) -> str:
        """``optimizer_impl``, or when that is auto the implementation the loop's framework
        picks (``auto`` left: torch's own choice for the target)."""
        if self.optimizer_impl != "auto":
            return self.optimizer_impl
        if self.inference or self.optimizer not in ("adam", "adamw"):
            return "auto"
        if not find_loop(self.loop).framework_optimizer:
            return "auto"
        from torchdoctor.estimate.loops import hf_trainer_defaults

        return hf_trainer_defaults().optimizer_impl

    def describe(self) -> str:
        if self.inference:
            return f"inference, batch {self.batch_size}, {self.precision}"
        parts = [f"batch {self.batch_size}", self.precision, self.optimizer]
        if self.optimizer_impl != "auto":
            parts[-1] += f" ({self.optimizer_impl})"
        elif self.optimizer_impl_used() != "auto":
            parts[-1] += f" ({self.optimizer_impl_used()}, the {self.loop} default)"
        if self.grad_accumulation > 1:
            parts.append(f"{self.grad_accumulation} micro-batches accumulated")
        if self.checkpointing:
            parts.append("activation checkpointing")
        return ", ".join(parts)


@dataclass(frozen=True)
class Target:
    """Where the step would run: the CPU, or a CUDA GPU described by its profile."""

    device: str = "cpu"
    gpu: GpuProfile | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"unknown device {self.device!r}: use cpu or cuda")
        if self.device == "cuda" and self.gpu is None:
            raise ParameterError(
                "{} needs a GPU: pass {} or {}", ("device", "cuda"), "gpu", "gpu_memory"
            )

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def describe(self) -> str:
        return self.gpu.name if self.gpu is not None else "CPU"
