"""Speed of ``torchdoctor estimate`` on GPT-2 small (124 M parameters, sequence 1024, batch 8).

Targets (issue 5, on a 2-core machine): the estimate in <= 10 s, ``--max-batch`` in <= 60 s;
exits 1 on a miss. The estimate is timed as the CLI runs it (the step under its loop, then under
each other loop that fits the model, to show the loop choice) and as one trace alone
(``compare_loops=False``). Machines are noisy, so next to the wall-clock times this prints the
CPU time the process used and the load average.

    python benchmarks/estimate_speed.py [--gpu A100-80GB]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import estimate_models as models  # noqa: E402
from scorecard import Scorecard  # noqa: E402
from torchdoctor.estimate.api import estimate, max_batch  # noqa: E402

ESTIMATE_TARGET_S = 10.0
MAX_BATCH_TARGET_S = 60.0


def timed(label: str, fn) -> tuple[object, float]:
    started, cpu_started = time.perf_counter(), time.process_time()
    result = fn()
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    print(f"{label:<60} {seconds:6.2f} s wall {cpu:6.2f} s CPU", flush=True)
    return result, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="A100-80GB", help="GPU profile of the CUDA estimates")
    args = parser.parse_args()
    torch.set_num_threads(2)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}")
    common = dict(tokens=1024)
    cuda = dict(device="cuda", gpu=args.gpu)
    estimates = []
    first, seconds = timed(
        "estimate, CUDA target, batch 8 (first call, loops compared)",
        lambda: estimate(models.gpt2_small, batch_size=8, **common, **cuda),
    )
    estimates.append(seconds)
    runs = [
        ("estimate, CUDA target, batch 8 (again, loops compared)", {}),
        ("estimate, CUDA target, batch 8, one trace (compare_loops=False)",
         {"compare_loops": False}),
        ("estimate, CPU target, batch 8 (loops compared)", {"device": "cpu", "gpu": None}),
        ("estimate, CUDA target, batch 8, bf16-mixed (loops compared)",
         {"precision": "bf16-mixed"}),
    ]  # fmt: skip
    for label, changes in runs:
        options = {**common, **cuda, **changes}
        estimates.append(
            timed(label, lambda o=options: estimate(models.gpt2_small, batch_size=8, **o))[1]
        )
    found, search = timed(
        f"--max-batch on {args.gpu}",
        lambda: max_batch(models.gpt2_small, **common, **cuda),
    )
    print(
        f"batch 8 needs {first.total / 2**30:.2f} GiB on {args.gpu} ({first.setup.loop} loop); "
        f"largest batch {found.batch_size} after {len(found.probes)} simulated steps"
    )  # fmt: skip
    card = Scorecard("estimate_speed")
    slowest = max(estimates)
    card.check(
        "estimate, GPT-2 small seq 1024 batch 8, slowest of the runs above (wall)",
        slowest, f"{slowest:.1f} s (one trace, compare_loops=False: {estimates[2]:.1f} s)",
        at_most=ESTIMATE_TARGET_S, target=f"<= {ESTIMATE_TARGET_S:.0f} s",
    )  # fmt: skip
    card.check(
        f"--max-batch on {args.gpu} (wall)", search,
        f"{search:.1f} s, largest batch {found.batch_size}",
        at_most=MAX_BATCH_TARGET_S, target=f"<= {MAX_BATCH_TARGET_S:.0f} s",
    )  # fmt: skip
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
