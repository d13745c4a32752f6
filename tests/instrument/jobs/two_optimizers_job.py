"""A GAN's loop in small (pytorch/examples' dcgan): a generator and a discriminator, each with
its own optimizer of another class, both stepped on every batch."""

import torch
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    torch.manual_seed(0)
    generator = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)
    )
    discriminator = torch.nn.Linear(16, 1)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.01)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(96, 16)), batch_size=8)
    bce = torch.nn.BCEWithLogitsLoss()
    steps = 0
    for (real,) in loader:
        fake = generator(torch.randn(len(real), 8))
        opt_d.zero_grad()
        loss_d = bce(discriminator(real), torch.ones(len(real), 1))
        loss_d = loss_d + bce(discriminator(fake.detach()), torch.zeros(len(real), 1))
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        bce(discriminator(fake), torch.ones(len(real), 1)).backward()
        opt_g.step()
        steps += 1
    print(f"steps {steps}", flush=True)


if __name__ == "__main__":
    main()
