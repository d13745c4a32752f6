"""Many ranks on a small machine (issue 46): a 16-rank gloo job under `torchdoctor launch
--force` on 2 CPUs is recorded (every rank's steps) and diagnosed, its slow rank named (56 s
here at load 11). The heavier sizes (64 ranks, a day) are benchmarks, not tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.launch.test_launch import JOB, by_id
from torchdoctor import open_recording

RANKS = 16
SLOW = 5

# 16 interpreters importing torch on 2 shared CPUs: minutes, not seconds.
pytestmark = pytest.mark.timeout(900)


def test_sixteen_ranks_on_two_cpus_are_recorded_and_the_slow_one_named(tmp_path: Path) -> None:
    res = run_td(
        "launch", "--nproc-per-node", str(RANKS), "--force", "--out-dir", str(tmp_path), "--",
        JOB, "--slow-rank", str(SLOW), "--slow-ms", "60", "--samples", str(RANKS * 64 * 24),
        "--batch", "64",
        timeout=840,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    (rec,) = sorted(tmp_path.glob("*.sqlite"))
    with open_recording(rec) as r:
        ranks = {s["rank"] for s in r.steps()}
        assert ranks == set(range(RANKS))
        # launch folds by default (the policy is in the meta); a short job folds nothing
        assert r.meta["compaction"]["bucket_s"] == 60 and r.compaction is None
    diag = run_td("diagnose", "--json", str(rec), timeout=300)
    assert diag.returncode == 0, diag.stderr
    findings = json.loads(diag.stdout)["findings"]
    straggler = by_id(findings, "rank-straggler")
    assert straggler["settings"]["rank"] == SLOW
