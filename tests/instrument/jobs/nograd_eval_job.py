"""A nanoGPT-shaped loop: batches cut from a token tensor by hand (no DataLoader), AdamW, and
every EVERY steps an ``estimate_loss`` under ``@torch.no_grad()`` with the model in eval mode,
a few forward passes on batches it builds itself (nanoGPT's train.py, much smaller).

argv[1]: ``eval`` (the evaluation as above), ``none`` (no evaluation), ``teacher`` (each step
also calls a frozen teacher in eval mode once under no_grad, as distillation does: part of the
step, never an evaluation). Prints one JSON line: the loop's own measure of each training step
(from the last optimizer step to this one, less the evaluation it ran) and of each evaluation.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

MODE = sys.argv[1]
STEPS = 24
EVERY = 6
EVAL_ITERS = 12  # forward passes per evaluation (x2: train and val splits)
BLOCK, BATCH, VOCAB, WIDTH = 32, 8, 64, 64

torch.manual_seed(0)
data = torch.randint(0, VOCAB, (20_000,))


def get_batch():
    ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
    x = torch.stack([data[i : i + BLOCK] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])
    return x, y


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(4)]
        )  # noqa: E501
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x, y=None):
        logits = self.head(self.blocks(self.emb(x)))
        loss = (
            None if y is None else nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        )
        return logits, loss


model = TinyGPT()
teacher = TinyGPT().eval()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


@torch.no_grad()
def estimate_loss() -> float:
    model.eval()
    total = 0.0
    for _split in ("train", "val"):
        for _ in range(EVAL_ITERS):
            x, y = get_batch()
            _, loss = model(x, y)
            total += loss.item()
    model.train()
    return total


own_steps: list[float] = []
own_evals: list[float] = []
x, y = get_batch()
last = time.perf_counter()
for it in range(STEPS):
    evaluated = 0.0
    if MODE == "eval" and it % EVERY == EVERY - 1:
        t0 = time.perf_counter()
        estimate_loss()
        evaluated = time.perf_counter() - t0
        own_evals.append(evaluated)
    logits, loss = model(x, y)
    if MODE == "teacher":
        with torch.no_grad():
            t_logits, _ = teacher(x)
        loss = loss + nn.functional.mse_loss(logits, t_logits)
    x, y = get_batch()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    now = time.perf_counter()
    own_steps.append(now - last - evaluated)
    last = now
print(json.dumps({"steps": own_steps, "evaluations": own_evals}))
