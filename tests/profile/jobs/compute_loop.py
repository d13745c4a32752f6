"""A training loop whose step is compute and nothing else: tensors already in memory, no
DataLoader, no sleep, and one host-device sync per step at a known line (``loss.item()``).

argv: SECONDS (trains for that long)
"""

import sys
import time

import torch

seconds = float(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
losses = []
deadline = time.perf_counter() + seconds
while time.perf_counter() < deadline:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())  # ITEM-LINE
print(f"done: {len(losses)} steps", flush=True)
