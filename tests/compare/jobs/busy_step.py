"""A compute-bound training loop: every step is matrix products on one torch thread, with no
data wait. ``python busy_step.py STEPS``. Its step time follows the CPU time it gets, so a
neighbour that saturates the CPUs slows it (tests/compare: the pair compare will not judge)."""

import sys

import torch


def main() -> None:
    steps = int(sys.argv[1])
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 256), torch.randn(256, 1)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
