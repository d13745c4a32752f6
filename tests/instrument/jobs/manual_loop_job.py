"""Training loops as research code writes them, for the step-boundary tests.

``--mode manual``: word_language_model style - batches cut from one tensor (no DataLoader),
parameters updated by hand (``p.data.add_(p.grad, alpha=-lr)``), no torch.optim at all.
``--mode accumulate``: a DataLoader and an optimizer stepped once every ``--accumulate``
backward passes (gradient accumulation).
``--mode autograd``: like manual, with ``torch.autograd.backward(loss)`` instead.
Prints the number of optimizer updates (manual: parameter updates) it made.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=("manual", "autograd", "accumulate"), required=True)
p.add_argument("--batches", type=int, default=100)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--accumulate", type=int, default=4)
args = p.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
loss_fn = nn.CrossEntropyLoss()
data = torch.randn(args.batches * args.batch_size, 32)
target = torch.randint(0, 8, (args.batches * args.batch_size,))
updates = 0
if args.mode in ("manual", "autograd"):
    lr = 0.1
    for i in range(0, data.size(0), args.batch_size):
        x, y = data[i : i + args.batch_size], target[i : i + args.batch_size]
        model.zero_grad()
        loss = loss_fn(model(x), y)
        if args.mode == "manual":
            loss.backward()
        else:
            torch.autograd.backward(loss)
        with torch.no_grad():
            for param in model.parameters():
                param.data.add_(param.grad, alpha=-lr)
        updates += 1
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(data, target), batch_size=args.batch_size)
    for i, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y) / args.accumulate
        loss.backward()
        if (i + 1) % args.accumulate == 0:
            opt.step()
            opt.zero_grad()
            updates += 1
print(f"updates {updates}", flush=True)
