"""A small CUDA training loop for benchmarks/gpu_check.sh: a known, checkable GPU footprint.

An MLP trained on synthetic data for a fixed time, fed by a DataLoader with worker processes
(which do not touch the GPU). At the end it prints what PyTorch itself holds on the GPU, so the
check can set NVML's per-process figure, as torchdoctor recorded it, beside it.

    python benchmarks/gpu_train_loop.py [--seconds S] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Synthetic(Dataset):
    def __init__(self, n: int, features: int) -> None:
        self.n, self.features = n, features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.features, generator=g)
        return x, (x[:8].sum() > 0).long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_train_loop: torch sees no CUDA device")

    device = torch.device("cuda")
    features = 4096
    model = nn.Sequential(
        nn.Linear(features, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 2)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(
        Synthetic(1 << 20, features),
        batch_size=512,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        pin_memory=True,
    )
    steps = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # Several passes per batch keep the GPU busy between the workers' batches.
            for _ in range(4):
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            steps += 1
            if time.monotonic() >= end:
                break
    torch.cuda.synchronize()
    print(
        "gpu_train_loop:",
        json.dumps(
            {
                "pid": os.getpid(),
                "steps": steps,
                "loss": round(float(loss), 4),
                "torch_memory_reserved": torch.cuda.memory_reserved(),
                "torch_max_memory_allocated": torch.cuda.max_memory_allocated(),
                "device": torch.cuda.get_device_name(0),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
