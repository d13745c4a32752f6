"""Healthy: in-memory tensors, a model big enough to keep the CPUs busy, default threads.

The data set is a preloaded tensor, so the DataLoader gathers a batch in about a millisecond
while the model computes for tens (a 1024-wide MLP: a 512-wide one computed so fast on a
recent CPU that the batch's gathering was 15 % of the step, a true data wait). torchdoctor
should find nothing to fix (at most notes).

    python healthy.py
"""

from __future__ import annotations

import torch
from _common import apply_threads, loader_kwargs, mlp, parser, train
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    args = parser(__doc__.splitlines()[0], steps=400, batch_size=256).parse_args()
    apply_threads(args)
    torch.manual_seed(0)
    x = torch.randn(8192, 784)
    y = torch.randint(0, 10, (8192,))
    loader = DataLoader(TensorDataset(x, y), **loader_kwargs(args))
    train(mlp(784, 1024), lambda: loader, args.steps, seconds=args.seconds)


if __name__ == "__main__":
    main()
