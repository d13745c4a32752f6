"""A streaming training loop: an IterableDataset, sharded across the DataLoader's workers.

``python iterable_job.py WORKERS SAMPLES``; prints the steps and samples it trained on, which a
recording of it must hold exactly. SAMPLES not a multiple of the batch size times the workers:
each worker's last batch is a short one."""

import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        first, stride = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, self.n, stride):
            g = torch.Generator().manual_seed(i)
            yield torch.randn(16, generator=g), torch.randn(1, generator=g)


def main() -> None:
    workers, samples = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Stream(samples), batch_size=8, num_workers=workers)
    steps = seen = 0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        seen += len(x)
    print(f"steps {steps} samples {seen}", flush=True)


if __name__ == "__main__":
    main()
