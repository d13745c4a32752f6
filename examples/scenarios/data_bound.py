"""Data-bound: every sample waits on (simulated) network storage, with num_workers=0.

Each ``__getitem__`` blocks 1.5 ms like a read from network storage, then decodes a little:
the training loop spends most of each step waiting for its batch. torchdoctor finds
``dataloader-bound`` and recommends num_workers (and persistent workers); workers overlap
the waits, so the fix helps even on a 2-core machine.

    python data_bound.py                    # ~15 s, data-bound
    python data_bound.py --num-workers 4 --persistent-workers
"""

from __future__ import annotations

import time

import torch
from _common import apply_threads, loader_kwargs, mlp, parser, train
from torch.utils.data import DataLoader, Dataset

STORAGE_LATENCY_S = 0.0015


class RemoteSamples(Dataset):
    def __init__(self, n: int, features: int = 256) -> None:
        self.n, self.features = n, features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(STORAGE_LATENCY_S)  # the read: the process blocks, the CPU is free
        g = torch.Generator().manual_seed(i)
        x = torch.rand(self.features, generator=g)  # the "decode"
        return (x - 0.5) * 2, i % 10


def main() -> None:
    args = parser(__doc__.splitlines()[0], steps=250, batch_size=32).parse_args()
    apply_threads(args)
    torch.manual_seed(0)
    data = RemoteSamples(n=4096)
    loader = DataLoader(data, **loader_kwargs(args))
    train(mlp(256, 512), lambda: loader, args.steps, seconds=args.seconds)


if __name__ == "__main__":
    main()
