"""A DDP job (gloo, CPU) whose forward, backward and optimizer steps take planned, different
times, measured by each rank itself: forward 2-3 ms, backward 9-11 ms, optimizer 17-18 ms, so
that a figure recorded in another's column (6 ms or more away) cannot pass for it. Each rank writes what it
measured of every step to OUT_DIR/rank<R>.json.

    timed_ranks_job.py OUT_DIR
"""

import json
import os
import sys
import time

import rank_exit  # beside this script
import torch
import torch.distributed as dist

STEPS = 10


def wait_ms(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


class SlowBackward(torch.autograd.Function):
    ms = 0.0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        wait_ms(SlowBackward.ms)
        return grad


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.forward_ms = 0.0

    def forward(self, x):
        wait_ms(self.forward_ms)
        return SlowBackward.apply(self.w * x)


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = Model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    plan = {}
    opt.register_step_pre_hook(lambda o, a, k: wait_ms(plan["optimizer"]))
    measured = []
    for step in range(STEPS):
        plan = {"forward": 2 + rank, "backward": 9 + step % 3, "optimizer": 17 + rank}
        model.forward_ms = plan["forward"]
        SlowBackward.ms = plan["backward"]
        x = torch.ones(4)
        t0 = time.perf_counter()
        loss = ddp(x).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        measured.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(measured, fh)
    dist.barrier()
    dist.destroy_process_group()
    rank_exit.leave()  # past torch's gloo teardown race: see rank_exit.py


if __name__ == "__main__":
    main()
