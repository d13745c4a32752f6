"""A small DDP training job (gloo, CPU) for the launch tests; each flag makes one known fault.

--slow-rank R --slow-ms N   rank R sleeps N ms in its data loading, per batch (a straggler)
--heavy                      many parameters, little compute (communication-bound)
--no-set-epoch               DistributedSampler without set_epoch
--uneven                     hand-made shards: rank 0 gets more batches than the others
--hang-rank R --hang-step K  rank R stops calling all-reduce at step K (sleeps)
--timeout S                  the process group's timeout (the user's)
"""

import argparse
import datetime
import time

import rank_exit  # beside this script
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


class Data(Dataset):
    def __init__(self, n, features, slow_s):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.slow_s = slow_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices):  # one sleep per batch, in the rank's own process
        if self.slow_s:
            time.sleep(self.slow_s)
        return [(self.x[i], self.y[i]) for i in indices]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--heavy", action="store_true")
    p.add_argument("--no-set-epoch", action="store_true")
    p.add_argument("--uneven", action="store_true")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=5)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if a.heavy:
        features, hidden = 256, 2048
        model = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.Linear(hidden, hidden),
            torch.nn.Linear(hidden, 1),
        )  # fmt: skip
    else:
        features, hidden = 128, 256
        model = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
            torch.nn.Tanh(), torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
            torch.nn.Linear(hidden, 1),
        )  # fmt: skip
    data = Data(a.samples, features, a.slow_ms / 1000 if rank == a.slow_rank else 0.0)
    if a.uneven:
        share = a.samples // (world + 1)
        start = rank * share
        stop = start + (2 * share if rank == 0 else share)
        loader = DataLoader(Subset(data, range(start, stop)), batch_size=a.batch)
        sampler = None
    else:
        sampler = DistributedSampler(data, shuffle=True)
        loader = DataLoader(data, batch_size=a.batch, sampler=sampler)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    step = 0
    for epoch in range(a.epochs):
        if sampler is not None and not a.no_set_epoch:
            sampler.set_epoch(epoch)
        for x, y in loader:
            if rank == a.hang_rank and step == a.hang_step:
                time.sleep(600)  # this rank stops calling all-reduce
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    dist.destroy_process_group()
    rank_exit.leave()  # past torch's gloo teardown race: see rank_exit.py


if __name__ == "__main__":
    main()
