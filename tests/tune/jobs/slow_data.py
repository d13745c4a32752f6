"""A tiny data-bound training job for tune's tests: each sample waits like a slow disk read.

    python slow_data.py [--workers N] [--sample-ms MS] [--step-ms MS] [--crash-with-workers N]
                        [--hang-with-workers N] [--steps N] [--ready FILE] [--exit-s S]

--step-ms adds a wait to every training step that no setting can shorten (a GPU kernel's
time, seen from the CPU): with --sample-ms 0 it makes a healthy job.

--crash-with-workers / --hang-with-workers make the job fail or hang when its DataLoader runs
with exactly that many workers (as a tuned setting would make it), so the tests can watch
tune record the failure and go on. --ready writes the trainer's PID to FILE at its first step.
--exit-s makes the process take that long to exit once it stops (a slow interpreter exit).
"""

from __future__ import annotations

import argparse
import atexit
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowSamples(Dataset):
    def __init__(self, n: int, sample_ms: float) -> None:
        self.n = n
        self.sample_s = sample_ms / 1000

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.sample_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), i % 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--crash-with-workers", type=int, default=None)
    parser.add_argument("--hang-with-workers", type=int, default=None)
    parser.add_argument("--ready", default=None)
    parser.add_argument("--exit-s", type=float, default=0.0)
    args = parser.parse_args()
    if args.exit_s:
        atexit.register(time.sleep, args.exit_s)

    torch.manual_seed(0)
    data = SlowSamples(100000, args.sample_ms)
    loader = DataLoader(data, batch_size=args.batch_size, num_workers=args.workers)
    if args.crash_with_workers is not None and loader.num_workers == args.crash_with_workers:
        raise RuntimeError(f"this job cannot run with {loader.num_workers} workers")
    hang = args.hang_with_workers is not None and loader.num_workers == args.hang_with_workers
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
        opt.step()
        if step == 1 and args.ready:
            with open(args.ready + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(args.ready + ".tmp", args.ready)
        if hang and step == 3:
            while True:  # a deadlock, as far as anyone outside can tell
                time.sleep(1)
        if step >= args.steps:
            break


if __name__ == "__main__":
    main()
