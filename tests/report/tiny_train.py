"""A short real training job for the report tests: a small MLP on the CPU, one DataLoader worker."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2048, 64), torch.randint(0, 10, (2048,)))
    # A persistent worker lives through both epochs: a worker per epoch lived ~0.3 s on a
    # fast VM, and a CI run's sampler once saw none of it.
    loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=1, persistent_workers=True)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _epoch in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
