"""A small DDP job on the CPU (gloo): each rank trains a linear model on its own batches.

Run under torchrun; prints one line per rank with the rank, world size and the final loss,
which is the same on every rank when the gradients were really all-reduced.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    weight_sum = sum(p.detach().sum().item() for p in model.parameters())
    # one write(2) per line: two ranks share the job's output file
    line = f"rank {rank} of {world} on {os.uname().nodename}: weights {weight_sum:.6f}\n"
    os.write(1, line.encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if "ray" not in sys.modules:  # Ray Train runs this file in its worker, which must go on
        # Leave without the interpreter's teardown, where torch's gloo threads abort a rank
        # that trained to the end (8 of 30 runs of this file under plain torchrun, torch
        # 2.13): tests/launch/jobs/rank_exit.py says why.
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch" / "jobs"))
        from rank_exit import leave

        leave()
