"""A data-bound training loop: its dataset sleeps for every sample, as a slow disk or a costly
decode would make it wait. ``python slow_loader.py WORKERS STEPS [BATCH]``; the sleep per sample
is ``SLOW_LOADER_DELAY_S`` (seconds), read from the environment so that a slowed run has the
same command line as its baseline."""

import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

# 40 ms a sample, one sample a batch: the sleep dominates the step, so the step time of two
# runs of the same command differs by a few percent at most even on a loaded machine, which
# varies the wake-up latency of each sleep (~1 ms; a 5 ms sleep would vary by 20 %).
DELAY_S = float(os.environ.get("SLOW_LOADER_DELAY_S", "0.04"))


class SlowSamples(Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int):
        time.sleep(DELAY_S)
        return torch.ones(8) * (i % 7), torch.ones(1)


def main() -> None:
    workers, steps = int(sys.argv[1]), int(sys.argv[2])
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(SlowSamples(), batch_size=batch, num_workers=workers)
    for i, (x, y) in enumerate(loader):
        if i >= steps:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
