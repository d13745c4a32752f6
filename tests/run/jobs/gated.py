"""A tiny torch training loop that stops at gates the test opens, so the test knows exactly
when the job runs (and, with --watch, whether its recording is still open).

    python gated.py GATES_FOLDER [--watch FILE] [--steps N]

At each gate it writes ``<its pid>\\n`` into the FIFO ``GATES_FOLDER/ready`` and blocks until
the test opens and closes ``GATES_FOLDER/go``. Without --watch there is one gate, after the
first training step (its steps then reach the recorder). With --watch it trains inside
``torchdoctor.watch(FILE)`` and passes a second gate after the watch has stopped, while the
process still runs.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn


def gate(folder: str) -> None:
    with open(os.path.join(folder, "ready"), "w") as fh:
        fh.write(f"{os.getpid()}\n")
    with open(os.path.join(folder, "go")) as fh:
        fh.read()  # EOF once the test has opened and closed its end


def train(steps: int, folder: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1:
            gate(folder)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gates")
    parser.add_argument("--watch", default=None)
    parser.add_argument("--steps", type=int, default=1_000_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.watch is None:
        train(args.steps, args.gates)
        return
    import torchdoctor

    with torchdoctor.watch(args.watch, interval=0.2):
        train(args.steps, args.gates)
    gate(args.gates)


if __name__ == "__main__":
    main()
