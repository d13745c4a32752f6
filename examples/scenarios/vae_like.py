"""VAE-like: pytorch/examples' vae on the CPU - MNIST decoded per sample in the main process.

Each sample is decoded from bytes to a float tensor (what ``transforms.ToTensor`` does to an
MNIST image), 128 to a batch, with ``num_workers=0`` and torch's default threads; the model is
the example's 784-400-20 VAE. Loading takes a good share of each step, yet on a small machine
the trainer's threads use the CPUs a worker would need: a worker beside them made the real
example 16 % slower. torchdoctor should only advise what its figures bound (here: a worker
together with fewer threads, or nothing).

    python vae_like.py                      # ~15 s
    python vae_like.py --num-workers 1 --persistent-workers --threads 1
"""

from __future__ import annotations

import torch
from _common import apply_threads, loader_kwargs, parser, train
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


class Digits(Dataset):
    """28 x 28 bytes per sample, decoded and scaled per access as ToTensor does."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, (n, 784), generator=g, dtype=torch.uint8).numpy().tobytes()
        self.raw = [data[i * 784 : (i + 1) * 784] for i in range(n)]

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.frombuffer(bytearray(self.raw[i]), dtype=torch.uint8).view(1, 28, 28)
        return x.float().div(255), i % 10


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(784, 400), nn.Linear(400, 20), nn.Linear(400, 20)
        self.fc3, self.fc4 = nn.Linear(20, 400), nn.Linear(400, 784)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.relu(self.fc1(x.view(-1, 784)))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def vae_loss(model: nn.Module, x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    recon, mu, logvar = model(x)
    bce = F.binary_cross_entropy(recon, x.view(-1, 784), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return (bce + kld) / len(x)  # per sample: the scenarios' SGD step suits it


def main() -> None:
    args = parser(__doc__.splitlines()[0], steps=600, batch_size=128).parse_args()
    apply_threads(args)
    torch.manual_seed(0)
    loader = DataLoader(Digits(6400), **loader_kwargs(args))  # 50 steps an epoch
    model = VAE()
    train(model, lambda: loader, args.steps, seconds=args.seconds, loss_of=vae_loss)


if __name__ == "__main__":
    main()
