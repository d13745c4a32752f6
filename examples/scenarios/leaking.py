"""Leaking: the loop keeps every step's outputs, autograd graph included.

``history.append(out)`` looks harmless, but ``out`` still references the graph of its step,
so each step's activations stay alive: the trainer's memory grows by the same amount every
step until the machine swaps or the OOM killer ends the run. torchdoctor finds
``host-memory-leak`` with the growth per step and the time to exhaustion; ``--fixed`` keeps
``out.detach()`` summaries instead, as the recommendation says.

    python leaking.py            # ~10 s, grows ~0.6 MiB per step
    python leaking.py --fixed
"""

from __future__ import annotations

import torch
from _common import apply_threads, loader_kwargs, mlp, parser, train
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=1500, batch_size=64)
    p.add_argument("--fixed", action="store_true", help="keep detached values, not graphs")
    args = p.parse_args()
    apply_threads(args)
    torch.manual_seed(0)
    x = torch.randn(4096, 512)
    y = torch.randint(0, 10, (4096,))
    loader = DataLoader(TensorDataset(x, y), **loader_kwargs(args))
    history: list[torch.Tensor] = []

    def keep(out: torch.Tensor, loss: torch.Tensor) -> None:
        # The bug: `out` holds its step's graph and saved activations.
        history.append(out.detach().mean(0) if args.fixed else out)

    train(mlp(512, 768), lambda: loader, args.steps, on_step=keep)


if __name__ == "__main__":
    main()
