"""Accuracy of ``torchdoctor estimate`` for each training loop people write, on the CPU.

Every case estimates a step under the loop it names (``--loop``), then runs that loop for real:
written out by hand as users write it (examples/estimate_loops.py), or through the real
``transformers.Trainer.train()`` and ``lightning.Trainer.fit()``. The truth is the peak of
PyTorch's CPU allocator as ``torch.profiler(profile_memory=True)`` records it during the run,
plus the model state and batch that existed before: none of the estimator's code (its step,
its storage tracker, its accounting) runs in the real run.

Columns: the estimate under the case's loop against the real peak, and what the estimate
would be under ``frees-output`` (the loop torchdoctor assumed before loops were a choice).
Target: every case within 1 %; exits 1 on a miss.

    python benchmarks/estimate_loops.py [--cases NAME,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import estimate_loops as loops  # noqa: E402
import estimate_models as models  # noqa: E402
from scorecard import Scorecard  # noqa: E402
from torchdoctor.estimate.api import prepare  # noqa: E402

TARGET = 0.01


def _tokens(vocab: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, vocab, (rows, seq)), torch.randint(0, vocab, (rows, seq))


def nanogpt(batch: int, hold: bool = True):
    def real() -> int:
        model, make_batch = models.nanogpt()
        (x, y), _ = make_batch(batch)
        return loops.run_nanogpt(model, x, y, hold=hold)

    loop = "hand-written" if hold else "frees-output"
    return models.nanogpt, {"batch_size": batch, "loop": loop}, real


def classic(batch: int, accumulation: int = 1):
    def real() -> int:
        ids, targets = _tokens(2048, batch, 128)
        return loops.run_classic(models.gpt_tiny(), ids, targets, accumulation=accumulation)

    options = {"tokens": 128, "batch_size": batch, "grad_accumulation": accumulation}
    return models.gpt_tiny, options, real


def dict_output(batch: int):
    def real() -> int:
        model, make_batch, loss = models.dict_output()
        x, y = make_batch(batch)
        return loops.run_classic(model, x, y, loss_fn=loss)

    return models.dict_output, {"batch_size": batch}, real


def hf_trainer(batch: int, accumulation: int = 1):
    def real() -> int:
        ids, _ = _tokens(8192, 4 * batch * accumulation, 128)
        return loops.run_hf_trainer(models.hf_gpt2_tiny(), ids, batch, accumulation)

    options = {
        "tokens": 128,
        "batch_size": batch,
        "grad_accumulation": accumulation,
        "loop": "hf-trainer",
    }
    return models.hf_gpt2_tiny, options, real


def lightning(batch: int):
    def real() -> int:
        module, make_batch = models.lightning_lm()
        ids, targets = make_batch(4 * batch)
        return loops.run_lightning(module, ids, targets, batch)

    return models.lightning_lm, {"batch_size": batch, "loop": "lightning"}, real


SUITE = {
    "nanogpt-b4 (logits, loss = model(X, Y))": nanogpt(4),
    "nanogpt-b8 (logits, loss = model(X, Y))": nanogpt(8),
    "nanogpt-b4, loss = model(X, Y)[1]": nanogpt(4, hold=False),
    "classic out = model(x), gpt b8": classic(8),
    "accumulation 4 x out = model(x), gpt b4": classic(4, accumulation=4),
    "dict output, mlp b64": dict_output(64),
    "hf Trainer.train(), gpt2-tiny b8": hf_trainer(8),
    "hf Trainer.train(), gpt2-tiny b4 x 2 accum": hf_trainer(4, accumulation=2),
    "lightning Trainer.fit(), gpt b8": lightning(8),
}


def run(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        factory, options, real = SUITE[name]
        check, setup = prepare(factory, **options)
        started = time.perf_counter()
        estimate = check.estimate(setup).peak_allocated
        seconds = time.perf_counter() - started
        frees = estimate
        if setup.loop != "frees-output":
            frees = check.estimate(setup.with_(loop="frees-output")).peak_allocated
        torch.manual_seed(0)
        truth = real()
        rows.append(
            {
                "case": name,
                "loop": setup.loop,
                "estimate": estimate,
                "real": truth,
                "error": (estimate - truth) / truth,
                "as_frees_output": frees,
                "error_as_frees_output": (frees - truth) / truth,
                "estimate_seconds": round(seconds, 2),
            }
        )
        print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    return (
        f"{row['case']:<44} {row['loop']:<13} {row['estimate'] / 2**20:9.2f} MiB "
        f"{row['real'] / 2**20:9.2f} MiB {row['error']:+8.3%}   "
        f"{row['as_frees_output'] / 2**20:9.2f} MiB {row['error_as_frees_output']:+8.2%}"
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
    torch.set_num_threads(min(2, torch.get_num_threads()))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}")
    print(
        f"{'case':<44} {'loop':<13} {'estimate':>13} {'real':>13} {'error':>8}   "
        f"{'as frees-output':>13} {'error':>8}"
    )
    rows = run(names)
    worst = max(abs(r["error"]) for r in rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    card = Scorecard("estimate_loops")
    card.check(
        f"estimate, CPU peak vs a real run of each loop shape, worst of {len(rows)}",
        worst, f"{worst:.3%}", at_most=TARGET, target=f"<= {TARGET:.0%}",
    )  # fmt: skip
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
