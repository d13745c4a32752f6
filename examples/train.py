"""A small image classifier trained on synthetic data on the CPU: torchdoctor's demo job.

Each sample is "decoded" and augmented in the Dataset (as real image pipelines do), and the
DataLoader runs with num_workers=0 by default, so the training loop waits for its data most of
the time: a real, visible bottleneck that `torchdoctor run` finds. The augmentation is small
torch ops on one sample: the trainer's intra-op threads gain little on them, while DataLoader
workers (one torch thread each) load batches side by side.

    python examples/train.py                                # about 45 s on 2 CPUs, data-bound
    python examples/train.py --num-workers 2 --threads 1    # what torchdoctor recommends on 2 CPUs
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SyntheticImages(Dataset):
    """Images made from a seed, then blurred, cropped, flipped and normalized per sample."""

    def __init__(self, n: int, size: int = 64, classes: int = 10) -> None:
        self.n, self.size, self.classes = n, size, classes
        self.kernel = torch.full((3, 1, 5, 5), 1 / 25.0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        raw = torch.rand(3, self.size + 8, self.size + 8, generator=g)  # the "decoded" image
        # Augmentations on one sample at a time, as torchvision transforms do.
        x = raw
        for _ in range(20):
            x = nn.functional.conv2d(x.unsqueeze(0), self.kernel, padding=2, groups=3)[0]
        dx, dy = (int(v) for v in torch.randint(0, 8, (2,), generator=g))
        x = x[:, dy : dy + self.size, dx : dx + self.size]
        if torch.rand(1, generator=g).item() < 0.5:
            x = x.flip(-1)
        x = (x - x.mean()) / (x.std() + 1e-6)
        return x.contiguous(), i % self.classes


def make_model(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(4),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    parser.add_argument("--prefetch-factor", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = SyntheticImages(n=args.steps * args.batch_size)
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
        prefetch_factor=args.prefetch_factor if args.num_workers > 0 else None,
    )
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    step = 0
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        if step % 50 == 0:
            rate = step * args.batch_size / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {loss.item():.3f}  {rate:.0f} samples/s", flush=True)
    elapsed = time.perf_counter() - start
    print(
        f"done: {step} steps in {elapsed:.1f} s ({step * args.batch_size / elapsed:.0f} samples/s)"
    )


if __name__ == "__main__":
    main()
