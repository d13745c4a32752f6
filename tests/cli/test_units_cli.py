"""One size vocabulary through the real commands: 16G is 16 x 2^30 bytes in submit, estimate
and bench alike, 16GB is 16 x 10^9; durations have one default unit (seconds), and sbatch
refuses a bare number (Slurm would read minutes)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, run_td
from tests.helpers.dependencies import require
from tests.queue.conftest import one_gpu, queue_env  # noqa: F401 - the fixture

GPT = f"{REPO / 'examples' / 'estimate_models.py'}:gpt_tiny"


@pytest.mark.parametrize(
    ("text", "size"), [("16G", 16 * 2**30), ("16GiB", 16 * 2**30), ("16GB", 16 * 10**9)]
)
def test_submit_and_estimate_read_a_size_the_same(queue_env, text, size):  # noqa: F811
    q = queue_env(one_gpu(40))
    done = q.td(
        "submit", "--gpus", "1", "--vram", text, "--mem", "400M", "--json",
        "--", sys.executable, "-c", "pass",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["vram_bytes"] == size
    assert job["mem_bytes"] == 400 * 2**20
    estimate = run_td("estimate", GPT, "--tokens", "16", "--gpu-memory", text, "--json")
    assert estimate.returncode == 0, estimate.stderr
    assert json.loads(estimate.stdout)["target"]["gpu_memory_bytes"] == size


def test_bench_sizes_use_the_same_vocabulary():
    require("torch")
    done = run_td(
        "bench", "allreduce", "--backend", "gloo", "--nproc", "2", "--sizes", "16K,1KiB,2kB",
        "--ops", "all_reduce", "--iters", "1", "--warmup", "0", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    sizes = [row["size"] for row in json.loads(done.stdout)["rows"]]
    assert sizes == [16 * 1024, 1024, 2000]


def test_sbatch_time_refuses_a_bare_number_and_reads_the_rest(user):
    refused = user.td("sbatch", "--time", "5", "--", "python", "train.py")
    assert refused.returncode == 2
    assert "--time '5' has no unit: write 5s, 5m or a clock form" in refused.stderr


def test_tune_budget_too_short_is_said_in_seconds(user):
    done = user.td("tune", "--budget", "5", "--", sys.executable, "-c", "pass")
    assert done.returncode == 2
    # A bare number is seconds, as everywhere: 5 is 5 s, not 5 minutes.
    assert "--budget 5s is too short" in done.stderr
    assert not user.runs.exists()  # refused before any trial, no folder made
