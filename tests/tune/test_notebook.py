"""`torchdoctor.tune_dataloader` on real DataLoaders and a real training step, in-process."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, get_worker_info

import torchdoctor
from torchdoctor.tune.result import FAILED


class SlowReads(Dataset):
    """Each sample waits 5 ms like a read from slow storage; the CPU stays free."""

    def __init__(self, fail_with_workers: int | None = None) -> None:
        self.fail_with_workers = fail_with_workers

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int):
        info = get_worker_info()
        if info is not None and info.num_workers == self.fail_with_workers:
            raise OSError(f"cannot open shard {i} from {info.num_workers} workers")
        time.sleep(0.005)
        return torch.full((16,), float(i % 7)), i % 4


def training_step():
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []

    def step(batch):
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(len(x))

    return step, seen


def running_children() -> set[int]:
    """Our descendants still running (a zombie awaiting its reaper runs nothing)."""
    alive = set()
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.add(p.pid)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_tunes_a_slow_dataset_with_the_model_in_the_loop(one_thread):
    before = running_children()  # what earlier tests in this process left is not ours
    step, seen = training_step()
    # One worker count fails (a broken shard reader): recorded, and the search goes on.
    # One worker is no faster than none here (the step costs nothing to overlap with): the
    # search must look past that plateau.
    result = torchdoctor.tune_dataloader(
        SlowReads(fail_with_workers=3), batch_size=8, step=step, budget=60, trial_steps=15
    )
    assert result.original.num_workers == 0 and result.original.num_threads == 1
    assert result.changed, result.summary()
    assert result.recommended.num_workers in (2, 4)
    assert result.gain is not None and result.gain > 1.3
    assert result.verification.confirmed and min(result.verification.ratios) > 1
    assert result.dataloader_kwargs["num_workers"] == result.recommended.num_workers
    failed = [m for m in result.trials if m.status == FAILED]
    assert failed and all(m.config.num_workers == 3 for m in failed)
    assert "OSError: cannot open shard" in failed[0].reason
    # The user's step ran on real batches; the torch threads and the process are as before.
    assert seen and set(seen) == {8}
    assert torch.get_num_threads() == 1
    assert not running_children() - before  # no DataLoader worker left running
    text = result.summary()
    assert "verified gain" in text and f"num_workers={result.recommended.num_workers}" in text
    assert repr(result).startswith("TuneResult(recommended=")


def test_loader_that_fails_as_given_raises_the_users_error(one_thread):
    before = running_children()
    with pytest.raises(OSError, match="cannot open shard"):
        torchdoctor.tune_dataloader(
            SlowReads(fail_with_workers=1), batch_size=8, num_workers=1, budget=20
        )
    assert not running_children() - before
