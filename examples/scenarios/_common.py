"""What the scenario scripts share: their command line, a small model and the training loop.

Every scenario accepts the knobs torchdoctor's recommendations turn (``--num-workers``,
``--threads``, ``--persistent-workers``...), runs about 10-20 s by default, and ``--steps N``
makes a short run for tests. ``--seconds S`` trains for S seconds instead, whatever the machine's
speed: what a verdict over time needs (a fast machine runs a fixed step count in too little). The last line printed is the throughput.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn


def parser(description: str, *, steps: int, batch_size: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps in all")
    p.add_argument(
        "--seconds", type=float, default=None, help="train for this long instead of --steps"
    )
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader num_workers")
    p.add_argument("--prefetch-factor", type=int, default=None)
    p.add_argument("--persistent-workers", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    return p


def loader_kwargs(args: argparse.Namespace) -> dict:
    kw = {
        "batch_size": args.batch_size,
        "shuffle": True,
        "num_workers": args.num_workers,
        "drop_last": True,
    }
    if args.num_workers > 0:
        kw["persistent_workers"] = args.persistent_workers
        if args.prefetch_factor:
            kw["prefetch_factor"] = args.prefetch_factor
    return kw


def mlp(inputs: int, hidden: int, outputs: int = 10, layers: int = 3) -> nn.Module:
    mods: list[nn.Module] = []
    width = inputs
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, outputs))
    return nn.Sequential(*mods)


def finished(steps: int, seconds: float | None) -> Callable[[int], bool]:
    """When a run is over, given the steps made: after ``steps``, or ``seconds`` from now."""
    if seconds is None:
        return lambda step: step >= steps
    deadline = time.perf_counter() + seconds
    return lambda step: time.perf_counter() >= deadline


def train(
    model: nn.Module,
    batches: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    steps: int,
    *,
    seconds: float | None = None,
    on_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Train for ``steps`` optimizer steps (or, given ``seconds``, until that much time has
    passed), re-iterating ``batches()`` per epoch; print the rate. ``loss_of(model, x, y)``
    replaces the classifier's cross-entropy (a VAE's loss is not a function of one output)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    samples = 0
    start = time.perf_counter()
    done = finished(steps, seconds)
    while not done(step):
        for x, y in batches():
            opt.zero_grad(set_to_none=True)
            if loss_of is None:
                out = model(x)
                loss = loss_fn(out, y)
            else:
                loss = out = loss_of(model, x, y)
            loss.backward()
            opt.step()
            if on_step is not None:
                on_step(out, loss)
            step += 1
            samples += len(x)
            if done(step):
                break
    elapsed = time.perf_counter() - start
    print(f"done: {step} steps in {elapsed:.1f} s ({samples / elapsed:.0f} samples/s)", flush=True)


def apply_threads(args: argparse.Namespace, default: int | None = None) -> None:
    threads = args.threads or default
    if threads:
        torch.set_num_threads(threads)
