"""Thread-oversubscribed: torch.set_num_threads(32) whatever the machine has.

A copy-pasted ``torch.set_num_threads(32)`` (or OMP_NUM_THREADS=32 from a big server) on a
small machine: 32 OpenMP threads fight over a few CPUs, each step pays for preemption and
spinning at every parallel region. torchdoctor finds ``thread-oversubscription`` and gives
the exact thread count; ``--threads N`` applies it.

    python thread_oversubscribed.py             # 32 threads, ~15 s
    python thread_oversubscribed.py --threads 2
"""

from __future__ import annotations

import torch
from _common import apply_threads, loader_kwargs, mlp, parser, train
from torch.utils.data import DataLoader, TensorDataset

HARD_CODED_THREADS = 32


def main() -> None:
    args = parser(__doc__.splitlines()[0], steps=1500, batch_size=64).parse_args()
    apply_threads(args, default=HARD_CODED_THREADS)
    torch.manual_seed(0)
    x = torch.randn(4096, 256)
    y = torch.randint(0, 10, (4096,))
    loader = DataLoader(TensorDataset(x, y), **loader_kwargs(args))
    train(mlp(256, 256), lambda: loader, args.steps, seconds=args.seconds)


if __name__ == "__main__":
    main()
