"""Per-epoch workers: a compute-bound job whose DataLoader starts its workers again each epoch.

Two workers (``persistent_workers=False``, DataLoader's default) decode each sample with a
little CPU work, and each short epoch ends with the workers shut down and the next starts two
new ones: a long run has had dozens of worker processes, never more than two at once. The
model's compute dominates the step. torchdoctor should not call the threads oversubscribed
(the workers of different epochs never ran together), nor advise a thread count it has not
measured to help.

    python per_epoch_workers.py                 # ~15 s, 2 workers a epoch
    python per_epoch_workers.py --threads 1
"""

from __future__ import annotations

import torch
from _common import apply_threads, loader_kwargs, mlp, parser, train
from torch.utils.data import DataLoader, Dataset


class DecodedSamples(Dataset):
    def __init__(self, n: int, features: int = 512) -> None:
        self.n, self.features = n, features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        x = torch.rand(self.features, generator=g)
        m = torch.rand(64, 64, generator=g)
        for _ in range(16):  # the "decode": ~0.3 ms of CPU per sample, in the worker
            m = torch.tanh(m @ m * 0.1)
        return x + m.mean(), i % 10


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=600, batch_size=64)
    p.set_defaults(num_workers=2)
    args = p.parse_args()
    apply_threads(args)
    torch.manual_seed(0)
    loader = DataLoader(DecodedSamples(1024), **loader_kwargs(args))  # 16 steps an epoch
    train(mlp(512, 1024), lambda: loader, args.steps, seconds=args.seconds)


if __name__ == "__main__":
    main()
