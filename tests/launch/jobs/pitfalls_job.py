"""A tiny DDP job (gloo, CPU) with one distributed mistake per flag, and its fix per flag.

--no-sampler           plain DataLoader(shuffle=False): every rank draws the same samples
--iterable             an IterableDataset that does not split by rank
--split-by-rank        (with --iterable) the fix: each rank takes every world-th sample
--seed-per-rank        DistributedSampler(seed=rank): the shards overlap
--dataparallel         nn.DataParallel instead of DDP (no GPU: it runs the module as is)
--batchnorm            a BatchNorm1d layer (with --batch below 16: unsynchronised statistics)
--accumulate K         K micro-steps per optimizer step, all-reducing on each
--no-sync              (with --accumulate) the fix: model.no_sync() on all but the last
--find-unused          find_unused_parameters=True on a model that uses every parameter
--fp16                 CPU autocast with float16, no GradScaler
--scaler               (with --fp16) scale the loss with a GradScaler
--workers N            DataLoader workers (the fingerprint starts after their prefetched batches)
--hostile-indices      a batch sampler whose index lists fail to print (repr raises): the agent's
                       fingerprint fails, switches the agent off, and the job trains on
--overflow             (with --scaler) a loss so large its scaled gradients are inf: every
                       step skipped, the scale halving each time
"""

import argparse
import contextlib

import rank_exit  # beside this script
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset


class HostileList(list):
    """An index list that DataLoader indexes with as usual, and that fails to print."""

    def __repr__(self):
        raise RuntimeError("this index list does not print")


class HostileBatches:
    def __init__(self, n, batch):
        self.n, self.batch = n, batch

    def __iter__(self):
        for start in range(0, self.n, self.batch):
            yield HostileList(range(start, min(start + self.batch, self.n)))

    def __len__(self):
        return (self.n + self.batch - 1) // self.batch


class Stream(IterableDataset):
    def __init__(self, x, y, split):
        self.x, self.y, self.split = x, y, split

    def __iter__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        for i in range(len(self.x)):
            if not self.split or i % world == rank:
                yield self.x[i], self.y[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--no-sampler", action="store_true")
    p.add_argument("--iterable", action="store_true")
    p.add_argument("--split-by-rank", action="store_true")
    p.add_argument("--seed-per-rank", action="store_true")
    p.add_argument("--dataparallel", action="store_true")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--find-unused", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--scaler", action="store_true")
    p.add_argument("--overflow", action="store_true")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--hostile-indices", action="store_true")
    p.add_argument("--hidden", type=int, default=64)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.samples, 32, generator=g)
    y = torch.randn(a.samples, 1, generator=g)
    layers = [torch.nn.Linear(32, a.hidden)]
    if a.batchnorm:
        layers.append(torch.nn.BatchNorm1d(a.hidden))
    layers += [torch.nn.Tanh(), torch.nn.Linear(a.hidden, a.hidden), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(a.hidden, 1))
    model = torch.nn.Sequential(*layers)
    sampler = None
    if a.iterable:
        loader = DataLoader(Stream(x, y, a.split_by_rank), batch_size=a.batch)
    elif a.hostile_indices:
        batches = HostileBatches(a.samples, a.batch)
        loader = DataLoader(TensorDataset(x, y), batch_sampler=batches, num_workers=a.workers)
    elif a.no_sampler:
        loader = DataLoader(
            TensorDataset(x, y), batch_size=a.batch, shuffle=False, num_workers=a.workers
        )
    else:
        seed = rank if a.seed_per_rank else 0
        sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=seed)
        loader = DataLoader(TensorDataset(x, y), batch_size=a.batch, sampler=sampler)
    if a.dataparallel:
        net = torch.nn.DataParallel(model)
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=a.find_unused)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu") if a.scaler else None
    for epoch in range(a.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):
            last = (i + 1) % a.accumulate == 0
            quiet = a.no_sync and not last and not a.dataparallel
            with net.no_sync() if quiet else contextlib.nullcontext():
                if a.fp16:
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = torch.nn.functional.mse_loss(net(xb).float(), yb)
                else:
                    loss = torch.nn.functional.mse_loss(net(xb), yb)
                loss = loss / a.accumulate
                if a.overflow:
                    loss = loss * 1e36
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
            if last:
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
    dist.barrier()  # every rank done with its collectives before the group goes
    dist.destroy_process_group()
    rank_exit.leave()  # past torch's gloo teardown race: see rank_exit.py


if __name__ == "__main__":
    main()
