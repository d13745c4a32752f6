"""A training loop whose step is compute and nothing else: tensors already in memory, no
DataLoader, no sleep, and one host-device sync per step at a known line (``loss.item()``).

argv: SECONDS [--after-window S]. Trains for SECONDS; with ``--after-window S``, goes on until
a profiler trace is in ``$TORCHDOCTOR_PROFILE_DIR`` and S seconds more (at most 90 s in all):
the step a window is planned at follows the pace the recorder measured, which a busy test box
varies, and the job must still be stepping when it comes.
"""

import os
import sys
import time
from pathlib import Path

import torch

seconds = float(sys.argv[1])
after = (
    float(sys.argv[sys.argv.index("--after-window") + 1]) if "--after-window" in sys.argv else None
)
folder = Path(os.environ.get("TORCHDOCTOR_PROFILE_DIR", "/nonexistent"))
torch.manual_seed(0)
# One thread: on a 2-CPU test box torch's two would fill both CPUs, and diagnose would rightly
# name cpu-saturated as what the GPU waits for instead of the step's own ops.
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
losses = []
start = time.perf_counter()
traced_at = None
while True:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())  # ITEM-LINE
    now = time.perf_counter()
    if now - start < seconds:
        continue
    if after is None or now - start >= 90:
        break
    if traced_at is None and any(folder.glob("*.pt.trace.json.gz")):
        traced_at = now
    if traced_at is not None and now - traced_at >= after:
        break
print(f"done: {len(losses)} steps", flush=True)
