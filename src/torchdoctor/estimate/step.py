"""The training step the estimator traces, the same code for fake and real tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.tracker import LiveStorageTracker
from torchdoctor.estimate.workload import call_model

STEPS = 2
FP16_LOSS_SCALE = 65536.0  # torch.amp.GradScaler's initial scale


def low_precision_dtype(setup: TrainingSetup) -> torch.dtype | None:
    """The autocast dtype of a mixed-precision set-up, else None."""
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(setup.precision)


def make_optimizer(
    params: list[torch.nn.Parameter], setup: TrainingSetup, target: Target
) -> torch.optim.Optimizer:
    """The optimizer with the implementation torch would pick on the target, unless forced."""
    impl: dict[str, bool] = {}
    if setup.optimizer_impl == "fused":
        impl = {"fused": True}
    elif setup.optimizer_impl == "foreach" or (setup.optimizer_impl == "auto" and target.is_cuda):
        # torch defaults to foreach when all parameters are on CUDA; on the CPU to a for-loop.
        impl = {"foreach": True}
    elif setup.optimizer_impl == "for-loop":
        impl = {"foreach": False}
    if setup.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3, **impl)
    if setup.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **impl)
    if setup.optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-3, **impl)
    return torch.optim.AdamW(params, lr=1e-3, **impl)


def cast_batch(batch: Any, dtype: torch.dtype) -> Any:
    """The batch with its floating tensors in ``dtype`` (inputs of a pure bf16 model)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {key: cast_batch(value, dtype) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cast_batch(value, dtype) for value in batch)
    return batch


def apply_checkpointing(model: torch.nn.Module) -> str:
    """Wrap the model's repeated blocks in non-reentrant activation checkpointing.

    The blocks are the children of the ModuleList/Sequential holding the most modules of one
    class (the layers of a transformer, the stages of a ResNet); failing that, the model's
    direct children. Returns what was wrapped.
    """
    best: tuple[int, str, list[torch.nn.Module]] = (0, "", [])
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = list(module.children())
            counts: dict[type, int] = {}
            for child in children:
                counts[type(child)] = counts.get(type(child), 0) + 1
            if counts:
                cls, count = max(counts.items(), key=lambda kv: kv[1])
                if count >= 2 and count > best[0]:
                    best = (count, name, [c for c in children if type(c) is cls])
    blocks = best[2] or [c for c in model.children() if any(True for _ in c.parameters())]
    for block in blocks:
        _checkpoint_forward(block)
    if best[2]:
        return f"{len(blocks)} x {type(blocks[0]).__name__} in {best[1] or 'the model'}"
    return f"{len(blocks)} top-level modules"


def _checkpoint_forward(block: torch.nn.Module) -> None:
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed  # type: ignore[method-assign]


def run_training(
    model: torch.nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], Any],
    optimizer: torch.optim.Optimizer | None,
    setup: TrainingSetup,
    tracker: LiveStorageTracker,
    on_grads: Callable[[], None],
    on_state: Callable[[], None],
) -> None:
    """Two training steps (or one inference forward), marking phases on ``tracker``."""
    inputs, target = batch
    low = low_precision_dtype(setup)
    autocast = (
        (lambda: torch.autocast("cpu", dtype=low)) if low is not None else contextlib.nullcontext
    )
    if setup.inference:
        tracker.set_phase("forward", 0)
        with torch.no_grad(), autocast():
            output = call_model(model, inputs)
        del output
        tracker.set_phase("done", 0)
        return
    assert optimizer is not None
    scale = torch.full((), FP16_LOSS_SCALE) if setup.precision == "fp16-mixed" else None
    for step in range(STEPS):
        for _micro in range(setup.grad_accumulation):
            tracker.set_phase("forward", step)
            with autocast():
                loss = loss_fn(call_model(model, inputs), target)
            if setup.grad_accumulation > 1:
                loss = loss / setup.grad_accumulation
            if scale is not None:
                loss = loss * scale
            tracker.set_phase("backward", step)
            loss.backward()
            del loss
        tracker.set_phase("optimizer", step)
        on_grads()
        if scale is not None:
            # GradScaler.unscale_: grads are divided in place by the scale.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, 1.0 / FP16_LOSS_SCALE)
        optimizer.step()
        on_state()
        tracker.set_phase("zero_grad", step)
        optimizer.zero_grad(set_to_none=True)
    tracker.set_phase("done", STEPS - 1)
