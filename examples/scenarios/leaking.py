"""Leaking: the loop keeps every step's embeddings for an end-of-epoch metric, on the graph.

``embeddings.append(h)`` looks harmless, but ``h`` is a live activation (64 x 2048 floats)
that also pins its step's input batch through the autograd graph: the trainer's memory
grows by the same ~0.75 MiB every step until the machine swaps or the OOM killer ends the
run. torchdoctor finds ``host-memory-leak`` with the growth per step and the time to
exhaustion; ``--fixed`` keeps ``h.detach().mean().item()`` (what the metric needs) instead.

    python leaking.py            # ~15 s
    python leaking.py --fixed
"""

from __future__ import annotations

import time

import torch
from _common import apply_threads, finished, loader_kwargs, parser
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=600, batch_size=64)
    p.add_argument("--fixed", action="store_true", help="keep a detached summary, not the graph")
    args = p.parse_args()
    apply_threads(args)
    torch.manual_seed(0)
    x = torch.randn(4096, 1024)
    y = torch.randint(0, 10, (4096,))
    loader = DataLoader(TensorDataset(x, y), **loader_kwargs(args))
    body = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU())
    head = nn.Linear(2048, 10)
    params = [*body.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    embeddings: list[torch.Tensor | float] = []
    step = 0
    start = time.perf_counter()
    done = finished(args.steps, args.seconds)
    while not done(step):
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            h = body(xb)
            loss = loss_fn(head(h), yb)
            loss.backward()
            opt.step()
            embeddings.append(h.detach().mean().item() if args.fixed else h)  # the bug: h
            step += 1
            if done(step):
                break
    elapsed = time.perf_counter() - start
    rate = step * args.batch_size / elapsed
    print(f"done: {step} steps in {elapsed:.1f} s ({rate:.0f} samples/s)", flush=True)


if __name__ == "__main__":
    main()
