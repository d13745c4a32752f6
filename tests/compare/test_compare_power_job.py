"""The slowed demo of benchmarks/compare_power.py: the delay it is given lies inside every
optimizer step (so the slowdown compare must find is the one applied), none without it, and
the benchmark is registered with `make bench`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.dependencies import require

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def run_job(delay: str) -> float:
    done = subprocess.run(
        [sys.executable, str(BENCH / "compare_power_job.py"), "--steps", "3", "--batch-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COMPARE_POWER_DELAY_S": delay},
    )
    assert done.returncode == 0, done.stderr
    match = re.search(r"done: 3 steps in ([0-9.]+) s", done.stdout)
    assert match, done.stdout
    return float(match.group(1))


def test_the_delay_is_spent_in_every_step() -> None:
    require("torch")
    # The delay lasts at least what it is asked: 3 steps of 0.4 s take 1.2 s or more.
    assert run_job("0.4") >= 1.2


def test_the_benchmark_is_registered_with_run_all() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import run_all
    finally:
        sys.path.remove(str(BENCH))
    assert "compare_power.py" in run_all.ORDER
