"""A loop whose step times are known: each batch waits a planned time in the DataLoader, each
step computes a planned time after it, and the job writes what it measured of every step
(perf_counter around ``next()`` and from one ``optimizer.step()`` to the next) as JSON.

    python known_steps_job.py OUT.json
"""

import json
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

# (data wait, compute) of each step in ms: distinct enough that a step recorded against the
# wrong one, or a wait counted in the wrong step, cannot pass for it.
PLAN = [(1, 4), (12, 2), (3, 15), (20, 1), (2, 8), (9, 9), (16, 3), (1, 20)] * 3


def wait_ms(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


class Planned(Dataset):
    def __len__(self):
        return len(PLAN)

    def __getitem__(self, i):
        wait_ms(PLAN[i][0])
        return torch.ones(4, 1)


torch.set_num_threads(1)
weight = torch.nn.Parameter(torch.zeros(1))
opt = torch.optim.SGD([weight], lr=0.0)
loader = DataLoader(Planned(), batch_size=None)
measured = []
it = iter(loader)
last = time.perf_counter()
for i in range(len(PLAN)):
    t0 = time.perf_counter()
    batch = next(it)
    waited = time.perf_counter() - t0
    wait_ms(PLAN[i][1])
    (weight * batch).sum().backward()
    opt.step()
    end = time.perf_counter()
    measured.append({"wait": waited, "wall": end - last, "t_end": time.time(), "n": len(batch)})
    last = end
with open(sys.argv[1], "w") as fh:
    json.dump(measured, fh)
