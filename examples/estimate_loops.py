"""The training loops people write, run for real on the CPU: the truth that
``torchdoctor estimate`` is measured against (benchmarks/estimate_accuracy.py, section "loops",
and tests/estimate/test_loops.py).

Each ``run_*`` function takes a model factory of examples/estimate_models.py, runs two optimizer
steps of one loop shape, written out here as users write it (or through the real
``transformers.Trainer.train()`` / ``lightning.Trainer.fit()``), and returns the peak bytes of
PyTorch's CPU allocator as ``torch.profiler`` records them
(``torchdoctor.estimate.measure.profiled_peak``), plus the model's parameters and buffers and the
batch that exist before the loop starts. None of the estimator's step code, tracker or
accounting runs in them.
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


def run_classic(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = _token_loss,
    accumulation: int = 1,
) -> int:
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

    return profiled_peak(train, [*_state(model), inputs, targets])


def run_frees_output(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """``_token_loss(model(x), y).backward()``: nothing keeps the output."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> None:
        for _step in range(STEPS):
            _token_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return profiled_peak(train, [*_state(model), inputs, targets])


def run_nanogpt(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """nanoGPT's train.py shape: ``logits, loss = model(X, Y); loss.backward();
    optimizer.step(); optimizer.zero_grad(set_to_none=True)`` (``logits`` lives on)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> None:
        for _step in range(STEPS):
            logits, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return profiled_peak(train, [*_state(model), x, y])


def run_hf_trainer(
    model: torch.nn.Module, ids: torch.Tensor, batch_size: int, accumulation: int = 1
) -> int:
    """``transformers.Trainer(model, TrainingArguments(max_steps=2, ...)).train()`` on a
    causal LM over ``ids`` (labels = input ids), its defaults kept (optimizer, clipping,
    data loader); ``ids`` holds more batches than two steps use, as a real data set does."""
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=STEPS,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        return profiled_peak(trainer.train, _state(model))


def run_lightning(module: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, batch_size: int) -> int:
    """``lightning.Trainer(max_steps=2).fit(module, loader)`` (automatic optimization, the
    module's own configure_optimizers) over a DataLoader of ``(ids, targets)``."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(ids, targets), batch_size=batch_size)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return profiled_peak(lambda: trainer.fit(module, loader), _state(module))
