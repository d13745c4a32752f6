"""A tiny training loop that synchronises with the device at known lines every step.

argv: STEPS [--print] [--adam] [--break-profiler] [--check-originals FILE] [--exit N] [--sleep S]
"""

import json
import sys
import time

import torch

args = sys.argv[1:]
steps = int(args[0])
torch.manual_seed(0)
if "--break-profiler" in args:
    import torch.profiler

    def broken(*a, **k):
        raise RuntimeError("profiler unavailable here")

    torch.profiler.profile = broken
originals = {
    name: torch.Tensor.__dict__.get(name)
    for name in ("item", "cpu", "tolist", "nonzero", "__repr__", "__format__")
}
originals["synchronize"] = torch.cuda.synchronize
sleep = float(args[args.index("--sleep") + 1]) if "--sleep" in args else 0.0
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
if "--adam" in args:
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)  # item() inside step()
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 32), torch.randn(16, 1)
wrapped_seen = False
for _ in range(steps):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()  # STEP-LINE
    value = loss.item()  # ITEM-LINE
    if "--print" in args:
        print(loss)  # PRINT-LINE
    if torch.Tensor.__dict__.get("item") is not originals["item"]:
        wrapped_seen = True
    if sleep:
        time.sleep(sleep)
if "--check-originals" in args:
    now = {name: torch.Tensor.__dict__.get(name) for name in originals if name != "synchronize"}
    now["synchronize"] = torch.cuda.synchronize
    with open(args[args.index("--check-originals") + 1], "w") as fh:
        json.dump(
            {
                "identical": all(now[k] is originals[k] for k in originals),
                "wrapped_seen": wrapped_seen,
            },
            fh,
        )
sys.exit(int(args[args.index("--exit") + 1]) if "--exit" in args else 0)
