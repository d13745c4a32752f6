"""The training step the estimator traces, the same code for fake and real tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torchdoctor.estimate.loops import HF_TRAINER, find_loop, hf_trainer_defaults
from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.tracker import LiveStorageTracker
from torchdoctor.estimate.workload import Batch, Workload, call_model, is_lightning_module

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
    chosen = setup.optimizer_impl_used()  # the HF Trainer's adamw_torch_fused, for one
    if chosen == "fused":
        impl = {"fused": True}
    elif chosen == "foreach" or (chosen == "auto" and target.is_cuda):
        # torch defaults to foreach when all parameters are on CUDA; on the CPU to a for-loop.
        impl = {"foreach": True}
    elif chosen == "for-loop":
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


def apply_loop_settings(model: torch.nn.Module, setup: TrainingSetup) -> None:
    """What the loop's framework changes on the model before training: the HF Trainer sets
    ``model.config.use_cache`` from its arguments (off by default: no KV cache in training)."""
    config = getattr(model, "config", None)
    if setup.loop == HF_TRAINER and hasattr(config, "use_cache"):
        config.use_cache = hf_trainer_defaults().use_cache


def make_batches(workload: Workload, model: torch.nn.Module, setup: TrainingSetup) -> list[Batch]:
    """The batches alive at once in the loop of ``setup``: one, or (HF Trainer) every
    micro-batch of an optimizer step plus the one its data loader has fetched ahead."""
    loop = find_loop(setup.loop)
    count = setup.grad_accumulation if loop.fetches_micro_batches and not setup.inference else 1
    count += 0 if setup.inference else loop.batches_ahead
    batches = [workload.make_batch(model, setup.batch_size) for _ in range(count)]
    if setup.precision == "bf16":
        batches = [cast_batch(batch, torch.bfloat16) for batch in batches]
    return batches


def forward(model: Any, batch: Batch, index: int) -> Any:
    """The step's forward: ``model(inputs)``, or a LightningModule's
    ``training_step(batch, batch_idx)``, which computes the loss too."""
    inputs, target = batch
    if is_lightning_module(model):
        return model.training_step(inputs if target is None else (inputs, target), index)
    return call_model(model, inputs)


def loss_of(model: Any, output: Any, batch: Batch, loss_fn: Callable[[Any, Any], Any]) -> Any:
    """The loss of a forward's output (a LightningModule's training_step returns it)."""
    if is_lightning_module(model):
        return output["loss"] if isinstance(output, Mapping) else output
    return loss_fn(output, batch[1])


def run_training(
    model: torch.nn.Module,
    batches: list[Batch],
    loss_fn: Callable[[Any, Any], Any],
    optimizer: torch.optim.Optimizer | None,
    setup: TrainingSetup,
    tracker: LiveStorageTracker,
    on_grads: Callable[[], None],
    on_state: Callable[[], None],
) -> None:
    """Two training steps (or one inference forward) of ``setup.loop``, marking phases on
    ``tracker``. What the loop keeps alive is kept alive here by the same references: a held
    output is rebound when the next forward returns, as ``out = model(x)`` is."""
    loop = find_loop(setup.loop)
    low = low_precision_dtype(setup)
    autocast = (
        (lambda: torch.autocast("cpu", dtype=low)) if low is not None else contextlib.nullcontext
    )
    if setup.inference:
        tracker.set_phase("forward", 0)
        with torch.no_grad(), autocast():
            output = call_model(model, batches[0][0])
        del output
        tracker.set_phase("done", 0)
        return
    assert optimizer is not None
    scale = torch.full((), FP16_LOSS_SCALE) if setup.precision == "fp16-mixed" else None
    accumulation = setup.grad_accumulation
    max_grad_norm = hf_trainer_defaults().max_grad_norm if loop.clips_gradients else 0.0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    output: Any = None
    loss: Any = None
    index = 0
    for step in range(STEPS):
        for micro in range(accumulation):
            batch = batches[micro % len(batches)]
            tracker.set_phase("forward", step)
            with autocast():
                if loop.holds_output:
                    output = forward(model, batch, index)
                    loss = loss_of(model, output, batch, loss_fn)
                else:
                    loss = loss_of(model, forward(model, batch, index), batch, loss_fn)
            index += 1
            if accumulation > 1 or loop.divides_loss_always:
                loss = loss / accumulation
            if scale is not None:
                loss = loss * scale
            if loop.zero_grad_after_forward and micro == 0:
                tracker.set_phase("zero_grad", step)
                optimizer.zero_grad(set_to_none=True)
            tracker.set_phase("backward", step)
            loss.backward()
            if not loop.holds_output:
                del loss
        tracker.set_phase("optimizer", step)
        on_grads()
        if scale is not None:
            # GradScaler.unscale_: grads are divided in place by the scale.
            grads = [p.grad for p in params if p.grad is not None]
            torch._foreach_mul_(grads, 1.0 / FP16_LOSS_SCALE)
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        on_state()
        if not loop.zero_grad_after_forward:
            tracker.set_phase("zero_grad", step)
            optimizer.zero_grad(set_to_none=True)
    tracker.set_phase("done", STEPS - 1)
