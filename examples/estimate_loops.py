"""The training loops people write, run for real: the truth that ``torchdoctor estimate`` is
measured against (benchmarks/estimate_loops.py, benchmarks/estimate_cuda_check.py and
tests/estimate/test_loops.py).

Each ``*_loop`` function returns a ``train()`` that runs two optimizer steps of one loop shape,
written out here as users write it, or through the real ``transformers.Trainer.train()`` /
``lightning.Trainer.fit()``, on whatever device the model and batch are on. Each ``run_*``
runs it on the CPU and returns the peak bytes of PyTorch's CPU allocator as ``torch.profiler``
records them (``torchdoctor.estimate.measure.profiled_peak``), plus the model's parameters and
buffers and the batch that exist before the loop starts. None of the estimator's step code,
tracker or accounting runs in them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from torchdoctor.estimate.measure import profiled_peak

STEPS = 2


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classic_loop(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = _token_loss,
    accumulation: int = 1,
) -> Callable[[], None]:
    """``out = model(x); loss = loss_fn(out, y); loss.backward()`` (``accumulation``
    micro-batches, each output held until the next forward returns), ``opt.step()``,
    ``opt.zero_grad(set_to_none=True)``, with AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> None:
        for _step in range(STEPS):
            for _micro in range(accumulation):
                out = model(inputs)
                loss = loss_fn(out, targets)
                if accumulation > 1:
                    loss = loss / accumulation
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def nanogpt_loop(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, hold: bool = True
) -> Callable[[], None]:
    """nanoGPT's train.py shape: ``logits, loss = model(X, Y); loss.backward();
    optimizer.step(); optimizer.zero_grad(set_to_none=True)`` (``logits`` lives on);
    ``hold=False``: ``loss = model(X, Y)[1]``, the logits dropped before backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> None:
        for _step in range(STEPS):
            if hold:
                logits, loss = model(x, y)
            else:
                loss = model(x, y)[1]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def hf_trainer_loop(
    model: torch.nn.Module,
    ids: torch.Tensor,
    batch_size: int,
    accumulation: int = 1,
    use_cpu: bool = True,
    output_dir: str | None = None,
) -> Callable[[], object]:
    """``transformers.Trainer(model, TrainingArguments(max_steps=2, ...)).train`` on a causal
    LM over ``ids`` (labels = input ids), its defaults kept (optimizer, clipping, data loader);
    ``ids`` should hold more batches than two steps use, as a real data set does. Building the
    Trainer moves the model to its device."""
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(prefix="torchdoctor-hf-"),
        max_steps=STEPS,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        use_cpu=use_cpu,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=dataset).train


def lightning_loop(
    module: torch.nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    batch_size: int,
    accelerator: str = "cpu",
) -> Callable[[], None]:
    """``lightning.Trainer(max_steps=2).fit(module, loader)`` (automatic optimization, the
    module's own configure_optimizers) over a DataLoader of ``(ids, targets)``."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(ids, targets), batch_size=batch_size)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return lambda: trainer.fit(module, loader)


def run_classic(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = _token_loss,
    accumulation: int = 1,
) -> int:
    """The CPU peak of :func:`classic_loop`."""
    train = classic_loop(model, inputs, targets, loss_fn, accumulation)
    return profiled_peak(train, [*_state(model), inputs, targets])


def run_nanogpt(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, hold: bool = True) -> int:
    """The CPU peak of :func:`nanogpt_loop`."""
    return profiled_peak(nanogpt_loop(model, x, y, hold), [*_state(model), x, y])


def run_hf_trainer(
    model: torch.nn.Module, ids: torch.Tensor, batch_size: int, accumulation: int = 1
) -> int:
    """The CPU peak of :func:`hf_trainer_loop` (the data set's rows are not counted: each
    batch the collator stacks from them is)."""
    with tempfile.TemporaryDirectory() as out:
        train = hf_trainer_loop(model, ids, batch_size, accumulation, output_dir=out)
        return profiled_peak(train, _state(model))


def run_lightning(
    module: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, batch_size: int
) -> int:
    """The CPU peak of :func:`lightning_loop`."""
    return profiled_peak(lightning_loop(module, ids, targets, batch_size), _state(module))
