"""Accuracy of ``torchdoctor estimate --device cpu`` against real CPU runs of the same step.

For every case of the suite the step (two training steps of the default hand-written loop:
forward, backward, optimizer step, zero_grad) is estimated under fake tensors and then run for
real on the CPU, by the estimator's own step code, where its peak is measured two ways:

- tensors: live tensor storage bytes, followed op by op on the real tensors by the estimator's
  own tracker, against the estimate's tensor peak (a check of fake against real kernels, not of
  the accounting: not independent);
- allocator: PyTorch's CPU allocator as torch.profiler(profile_memory=True) records it
  (independent accounting, the same loop code), which
  also sees scratch buffers that kernels allocate and free inside one op (oneDNN convolution and
  RNN scratchpads, packed bf16 matmul operands), memory that is not any tensor's, against the
  estimate's peak, which adds each such kernel's scratch measured once on zeros of its shapes.

Next to them, what the naive formula (params x 4 B x 2 x optimizer factor) and a
parameters-only count like accelerate's estimate-memory (4 x parameter bytes) would say.

    python benchmarks/estimate_accuracy.py [--cases NAME,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import estimate_models as models  # noqa: E402
from scorecard import Scorecard  # noqa: E402
from torchdoctor.estimate.fitcheck import estimate_workload  # noqa: E402
from torchdoctor.estimate.measure import measure_cpu_peak  # noqa: E402
from torchdoctor.estimate.setup import Target, TrainingSetup  # noqa: E402
from torchdoctor.estimate.spec import load_workload  # noqa: E402

TARGET = 0.01

# name -> (factory, workload options, set-up); the loop is the default, hand-written.
SUITE = {
    "cnn-fp32-adamw": (models.plain_cnn, {}, TrainingSetup(batch_size=32)),
    "resnet-bn-fp32-sgdm": (models.resnet, {}, TrainingSetup(batch_size=32, optimizer="sgd-momentum")),
    "resnet-bn-bf16mixed-sgd": (models.resnet, {}, TrainingSetup(batch_size=16, optimizer="sgd", precision="bf16-mixed")),
    "encoder-dropout-fp32-adamw": (models.transformer_encoder, {}, TrainingSetup(batch_size=16)),
    "encoder-dropout-bf16-sgdm": (models.transformer_encoder, {}, TrainingSetup(batch_size=16, precision="bf16", optimizer="sgd-momentum")),
    "gpt-sdpa-fp32-adamw": (models.gpt_tiny, {"tokens": 128}, TrainingSetup(batch_size=8)),
    "gpt-sdpa-bf16mixed-adamw": (models.gpt_tiny, {"tokens": 128}, TrainingSetup(batch_size=8, precision="bf16-mixed")),
    "gpt-dropout-bf16-adamw": (models.gpt_tiny_dropout, {"tokens": 128}, TrainingSetup(batch_size=8, precision="bf16")),
    "gpt-dropout-ckpt-fp32-adam": (models.gpt_tiny_dropout, {"tokens": 128}, TrainingSetup(batch_size=8, optimizer="adam", checkpointing=True)),
    "gpt-accum-fp32-adamw-foreach": (models.gpt_tiny, {"tokens": 128}, TrainingSetup(batch_size=4, grad_accumulation=2, optimizer_impl="foreach")),
    "vit-mha-fp32-adamw": (models.vit_tiny, {}, TrainingSetup(batch_size=16)),
    "vit-mha-bf16mixed-adamw-fused": (models.vit_tiny, {}, TrainingSetup(batch_size=16, precision="bf16-mixed", optimizer_impl="fused")),
    "lstm-fp32-sgd": (models.lstm, {}, TrainingSetup(batch_size=32, optimizer="sgd")),
    "mlp-dropout-fp32-adamw": (models.mlp_dropout, {}, TrainingSetup(batch_size=128)),
    "mlp-dropout-fp32-inference": (models.mlp_dropout, {}, TrainingSetup(batch_size=128, inference=True)),
}  # fmt: skip


def error(estimate: int, real: int) -> float:
    return (estimate - real) / real


def run(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        factory, options, setup = SUITE[name]
        workload = load_workload(factory, **options)
        started = time.perf_counter()
        estimate = estimate_workload(workload, setup, Target())
        estimate_seconds = time.perf_counter() - started
        real = measure_cpu_peak(workload, setup)
        rows.append(
            {
                "case": name,
                "estimate": estimate.peak_allocated,
                "estimate_tensors": estimate.tensor_peak,
                "real_storage": real.storage_peak,
                "real_allocator": real.allocator_peak,
                "naive_formula": estimate.baselines.naive_formula_bytes,
                "params_only": estimate.baselines.params_only_bytes,
                "peak_phase": estimate.peak_phase,
                "estimate_seconds": round(estimate_seconds, 2),
                "real_seconds": round(real.seconds, 2),
            }
        )
        print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    def pct(value: int, real: int) -> str:
        return f"{error(value, real):+8.2%}"

    return (
        f"{row['case']:<30} {row['estimate'] / 2**20:9.2f} MiB  "
        f"tensors {pct(row['estimate_tensors'], row['real_storage'])}  "
        f"allocator {pct(row['estimate'], row['real_allocator'])}  "
        f"naive {pct(row['naive_formula'], row['real_allocator'])}  "
        f"params-only {pct(row['params_only'], row['real_allocator'])}  "
        f"peak in {row['peak_phase']:<9} {row['estimate_seconds']:5.2f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()
    names = args.cases.split(",") if args.cases else list(SUITE)
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(SUITE)}")
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; error = (estimate - real) / real"
    )
    rows = run(names)
    worst_storage = max(abs(error(r["estimate_tensors"], r["real_storage"])) for r in rows)
    worst_allocator = max(abs(error(r["estimate"], r["real_allocator"])) for r in rows)
    worst_naive = max(abs(error(r["naive_formula"], r["real_allocator"])) for r in rows)
    worst_params = max(abs(error(r["params_only"], r["real_allocator"])) for r in rows)
    print(
        f"worst |error| over {len(rows)} cases: tensor bytes {worst_storage:.2%}, "
        f"vs allocator {worst_allocator:.2%}; naive formula {worst_naive:.1%}, "
        f"params-only {worst_params:.1%}"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    card = Scorecard("estimate_accuracy")
    card.check(
        f"estimate vs a real CPU run's allocator peak, worst of {len(rows)} cases",
        worst_allocator, f"{worst_allocator:.3%} (naive formula {worst_naive:.1%})",
        at_most=TARGET, target=f"<= {TARGET:.0%}",
    )  # fmt: skip
    card.check(
        "estimate's tensor bytes vs the real run's live storages, worst case",
        worst_storage, f"{worst_storage:.3%}", at_most=TARGET, target=f"<= {TARGET:.0%}",
    )  # fmt: skip
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
