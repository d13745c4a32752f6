"""A loop as the HF Trainer runs it: accelerate's prepare() wraps the DataLoader in a
DataLoaderShard built from it, and only the shard is iterated."""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    steps = 0
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        steps += 1
    print(f"{type(loader).__name__} steps {steps}", flush=True)


if __name__ == "__main__":
    main()
