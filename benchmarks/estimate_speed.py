"""Speed of ``torchdoctor estimate`` on GPT-2 small (124 M parameters, sequence 1024, batch 8).

Targets (issue 5, on a 2-core machine): the estimate in <= 10 s, ``--max-batch`` in <= 60 s.
Machines are noisy, so next to the wall-clock times this prints the CPU time the process used
and the ratio to a baseline measured in the same process: one real CPU training step of the
same model at batch 1, sequence 128.

    python benchmarks/estimate_speed.py [--gpu A100-80GB]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import estimate_models as models  # noqa: E402
from torchdoctor.estimate.api import estimate, max_batch  # noqa: E402


def real_step_seconds() -> float:
    """One real AdamW training step of GPT-2 small at batch 1, sequence 128, on the CPU."""
    model = models.gpt2_small()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 50257, (1, 128))
    started = time.perf_counter()
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), ids.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def timed(label: str, fn, baseline: float) -> object:
    started, cpu_started = time.perf_counter(), time.process_time()
    result = fn()
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    print(
        f"{label:<52} {seconds:6.2f} s wall {cpu:6.2f} s CPU  ({seconds / baseline:5.2f} x a real step)",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="A100-80GB", help="GPU profile of the CUDA estimates")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    baseline = real_step_seconds()
    print(f"{'baseline: real CPU step, batch 1, seq 128':<52} {baseline:6.2f} s")
    common = dict(tokens=1024)
    cuda = dict(device="cuda", gpu=args.gpu)
    first = timed(
        "estimate, CUDA target, batch 8 (first call)",
        lambda: estimate(models.gpt2_small, batch_size=8, **common, **cuda),
        baseline,
    )
    timed(
        "estimate, CUDA target, batch 8 (again)",
        lambda: estimate(models.gpt2_small, batch_size=8, **common, **cuda),
        baseline,
    )
    timed(
        "estimate, CPU target, batch 8",
        lambda: estimate(models.gpt2_small, batch_size=8, **common),
        baseline,
    )
    timed(
        "estimate, CUDA target, batch 8, bf16-mixed",
        lambda: estimate(models.gpt2_small, batch_size=8, precision="bf16-mixed", **common, **cuda),
        baseline,
    )
    found = timed(
        f"--max-batch on {args.gpu}",
        lambda: max_batch(models.gpt2_small, **common, **cuda),
        baseline,
    )
    print(
        f"batch 8 needs {first.total / 2**30:.2f} GiB on {args.gpu}; largest batch {found.batch_size} "
        f"after {len(found.probes)} simulated steps"
    )  # fmt: skip


if __name__ == "__main__":
    main()
