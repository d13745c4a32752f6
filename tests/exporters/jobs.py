"""A real CPU training job that runs until the test says stop (a file appears), so that the
test decides how long Prometheus watches it instead of guessing a duration."""

from __future__ import annotations

TRAIN = r"""
import os, sys
import torch
import torch.utils.data as tud

torch.set_num_threads(1)
stop = sys.argv[1]
ds = tud.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
epoch = 0
# Workers that are not persistent exit at the end of every epoch: the job's counters must not.
while not os.path.exists(stop) and epoch < 10000:
    for x, y in tud.DataLoader(ds, batch_size=16, num_workers=1, persistent_workers=False):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    epoch += 1
print("epochs", epoch, flush=True)
"""
