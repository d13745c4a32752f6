"""A script that rewrites sys.path before importing torch (as some launchers do)."""

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
# Drop every PYTHONPATH entry (the torchdoctor bootstrap among them) and put our folder first.
sys.path[:] = [here] + [p for p in sys.path if p and "bootstrap" not in p]

import torch  # noqa: E402

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(6):
    loss = model(torch.randn(3, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("sys.path job done")
