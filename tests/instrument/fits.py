"""Tiny real fits for the Lightning and Hugging Face tests: one model, data set and trainer
set-up per library, so each test states only what it varies."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset


@pytest.fixture(scope="module", autouse=True)
def _leave_the_process_as_found():
    """The libraries seed the global RNGs (HF's set_seed) and set variables on import: undo
    that, so later tests in this process see what they would have seen without these."""
    environ = dict(os.environ)
    states = random.getstate(), torch.random.get_rng_state()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    yield
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
    random.setstate(states[0])
    torch.random.set_rng_state(states[1])
    if numpy_state is not None:
        numpy.random.set_state(numpy_state)


def lightning_module(lightning, fail_with=None):
    """A linear regression; raises ``fail_with`` at its third training batch when given."""

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if fail_with is not None and batch_idx == 2:
                raise fail_with
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regression()


def lightning_fit(
    lightning, callback, *, samples, batch_size, val_samples=0, fail_with=None, **trainer_options
):
    """One epoch on the CPU, without progress bar, logger or checkpoints."""
    trainer = lightning.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        **trainer_options,
    )
    train = TensorDataset(torch.randn(samples, 4), torch.randn(samples, 1))
    loaders = [DataLoader(train, batch_size=batch_size)]
    if val_samples:
        val = TensorDataset(torch.randn(val_samples, 4), torch.randn(val_samples, 1))
        loaders.append(DataLoader(val, batch_size=batch_size))
    trainer.fit(lightning_module(lightning, fail_with), *loaders)
    return trainer


class PairDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 4)
        self.y = torch.randn(n, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class PlainRegression(torch.nn.Module):
    """A plain nn.Module: the Trainer needs only a dict with the loss. Raises ``fail_with``
    at its third call when given."""

    def __init__(self, fail_with=None):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_with = fail_with
        self.calls = 0

    def forward(self, x, labels):
        self.calls += 1
        if self.fail_with is not None and self.calls == 3:
            raise self.fail_with
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}


def hf_trainer(
    transformers,
    tmp_path,
    callback,
    *,
    samples,
    batch_size,
    eval_samples=0,
    fail_with=None,
    **argument_options,
):
    """A Trainer for one epoch on the CPU that saves, logs and reports nothing."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf-out"),
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        num_train_epochs=1,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        **argument_options,
    )
    return transformers.Trainer(
        model=PlainRegression(fail_with),
        args=args,
        train_dataset=PairDataset(samples),
        eval_dataset=PairDataset(eval_samples) if eval_samples else None,
        callbacks=[callback],
    )
