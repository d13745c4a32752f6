"""A compute-bound training loop: every step is matrix products on one torch thread, with no
data wait. ``python busy_step.py STEPS``. Its step time follows the CPU time it gets, so a
neighbour that saturates the CPUs slows it (tests/compare: the pair compare will not judge)."""

import sys

import torch


def main() -> None:
    steps = int(sys.argv[1])
    torch.set_num_threads(1)
    # Steps of tens of milliseconds: each spans many of the scheduler's time slices, so a
    # neighbour's share of the CPU shows in every step (1 ms steps ran whole inside the job's
    # own slices and came out as fast beside a hog as without it).
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(512, 1024), torch.randn(512, 1)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
