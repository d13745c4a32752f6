"""`make bench`: run every CPU benchmark in turn and print what each measured.

Each benchmark compares against a baseline run side by side in the same run and prints
ratios; none asserts a time. GPU-only checks (gpu_check.sh, estimate_cuda_check.py) run on a
GPU machine by hand and are skipped here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = [
    "snapshot_cost.py",
    "nvml_read_cost.py",
    "instrument_overhead.py",
    "estimate_accuracy.py",
    "estimate_speed.py",
    "advice_works.py",
    "tune_vs_grid.py",
    "top_overhead.py",
]


def main() -> int:
    only = set(sys.argv[1:])
    failed = []
    for name in ORDER:
        script = HERE / name
        if not script.exists() or (only and name not in only and script.stem not in only):
            continue
        print(f"\n=== {name} ===", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        print(f"--- {name}: exit {code}, {time.monotonic() - start:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"\nbenchmarks that failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
