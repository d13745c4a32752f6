"""A small real training loop on CPU that the instrumentation tests run as a child process.

Its stdout is deterministic (seeded losses), so runs with and without instrumentation can be
compared byte for byte. ``--measure FILE`` writes the loop's own timing of every step:
[data wait, step wall] in seconds, measured the way torchdoctor defines them.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


def busy(ms: float) -> None:
    """Compute for about ``ms`` milliseconds (results discarded: losses stay deterministic)."""
    end = time.perf_counter() + ms / 1000
    a = torch.ones(64, 64)
    while time.perf_counter() < end:
        a = (a @ a).clamp_(max=1.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--context", default=None)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--delay", type=float, default=0.0, help="seconds per sample")
    p.add_argument("--compute-ms", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--fork-child", action="store_true", help="fork a child that exits normally")
    p.add_argument("--measure", default=None)
    args = p.parse_args()

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    rank = 0
    if args.ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(
        SlowDataset(args.samples, args.delay),
        batch_size=args.batch_size,
        num_workers=args.workers,
        multiprocessing_context=args.context,
    )
    measured = []
    last_end = None
    for epoch in range(args.epochs):
        it = iter(loader)
        i = 0
        while True:
            t0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            busy(args.compute_ms)
            opt.zero_grad()
            loss.backward()
            opt.step()
            t2 = time.perf_counter()
            measured.append([t1 - t0, t2 - (last_end if last_end is not None else t0)])
            last_end = t2
            if rank == 0:
                print(f"epoch {epoch} step {i} loss {loss.item():.6f}", flush=True)
            i += 1
    if args.fork_child:
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs atexit handlers in the child: it must not resend our records
        os.waitpid(pid, 0)
    if args.measure:
        with open(args.measure, "w") as f:
            json.dump(measured, f)
    if args.ddp:
        torch.distributed.destroy_process_group()
    print("finished", flush=True)
    if args.ddp:
        # Past torch's gloo teardown race (CI: a rank aborted after "finished"): see
        # tests/launch/jobs/rank_exit.py.
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch" / "jobs"))
        from rank_exit import leave

        leave()


if __name__ == "__main__":
    main()
