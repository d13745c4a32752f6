"""The distributed mistakes, each made by a real 2-rank job (gloo, CPU) under `torchdoctor
launch`, named with its fix; the fix applied in a second run removes the finding.

The job is tests/launch/jobs/pitfalls_job.py: one flag per mistake, one per fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TORCHDOCTOR, run_td
from torchdoctor import open_recording
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.recordings import RecordingWatcher

JOB = str(Path(__file__).resolve().parent / "jobs" / "pitfalls_job.py")
PITFALL_RULES = {
    "data-not-sharded",
    "sampler-seed-mismatch",
    "dataparallel-used",
    "batchnorm-not-synced",
    "accumulation-without-no-sync",
    "unused-parameters-search",
    "fp16-without-scaler",
    "grad-scale-falling",
}


def launch(out: Path, *job_args: str) -> Path:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    res = run_td(
        "launch", "--nproc-per-node", "2", "--out-dir", str(out), "--", JOB, *job_args,
        env=env, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    recordings = sorted(out.glob("*.sqlite"))
    assert len(recordings) == 1, res.stderr
    return recordings[0]


def pitfalls(rec: Path) -> dict[str, dict]:
    res = run_td("diagnose", "--json", str(rec))
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)["findings"]
    return {f["id"]: f for f in found if f["id"] in PITFALL_RULES}


def events(rec: Path, kind: str) -> list[dict]:
    with open_recording(rec) as r:
        return [json.loads(e["detail"]) for e in r.rows("events", where={"kind": kind})]


@pytest.fixture(scope="module")
def correct(tmp_path_factory) -> Path:
    """Every fix applied: DistributedSampler with set_epoch, no_sync accumulation, float16
    autocast with a GradScaler."""
    out = tmp_path_factory.mktemp("correct")
    return launch(out, "--accumulate", "2", "--no-sync", "--fp16", "--scaler")


def test_correct_ddp_job_gets_none_of_the_pitfalls(correct: Path) -> None:
    assert pitfalls(correct) == {}
    prints = events(correct, "data-fingerprint")
    # Each rank fingerprinted each of its 2 epochs, and the ranks' shards differ.
    assert sorted((p["rank"], p["epoch"]) for p in prints) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({p["digest"] for p in prints if p["epoch"] == 0}) == 2
    pattern = [p for p in events(correct, "ddp-sync-pattern") if p["rank"] == 0][-1]
    assert pattern["synced_micro_steps"] == pattern["accumulating_steps"]


def test_unsharded_data_named_with_the_distributed_sampler_line(tmp_path: Path) -> None:
    found = pitfalls(launch(tmp_path, "--no-sampler"))
    f = found["data-not-sharded"]
    assert f["severity"] == "critical"
    assert "sampler = DistributedSampler(dataset)" in f["recommendation"]
    assert "sampler.set_epoch(epoch)" in f["recommendation"]
    assert "each epoch 2 times shorter" in f["expected_effect"]
    evidence = {e["label"]: e["value"] for e in f["evidence"]}
    assert evidence["ranks whose first batches have the same sample indices"] == "0, 1"
    assert evidence["epoch compared"] == 0  # named in the first epoch


def test_unsharded_data_with_loader_workers(tmp_path: Path) -> None:
    # A multi-worker iterator has taken its prefetched indices before the epoch's first
    # batch: the ranks' fingerprints start after them, at the same offset.
    rec = launch(tmp_path, "--no-sampler", "--workers", "2", "--epochs", "1")
    assert "data-not-sharded" in pitfalls(rec)


def test_a_fingerprint_that_fails_switches_the_agent_off_and_the_job_trains_on(
    tmp_path: Path,
) -> None:
    rec = launch(tmp_path, "--hostile-indices", "--epochs", "1")  # exit status 0 (asserted)
    off = events(rec, "instrumentation-disabled")
    assert sorted(d.get("where") for d in off) == ["data-fingerprint"] * 2, off  # said once a rank
    assert not events(rec, "data-fingerprint")


def test_top_names_unsharded_data_while_the_job_runs(tmp_path: Path) -> None:
    """top's recording watcher, on the live recording of a job still in its epochs."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    job = subprocess.Popen(
        [*TORCHDOCTOR, "launch", "--nproc-per-node", "2", "--out-dir", str(tmp_path), "--",
         JOB, "--no-sampler", "--epochs", "400", "--samples", "256"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        ids: set[str] = set()
        while "data-not-sharded" not in ids:
            assert job.poll() is None, "the job ended before top named it"
            assert time.monotonic() < deadline, ids
            time.sleep(1.0)
            recordings = sorted(tmp_path.glob("*.sqlite"))
            if not recordings:
                continue
            watcher = RecordingWatcher(Thresholds())  # a fresh look: diagnoses at once
            try:
                status = watcher.status(recordings[0])
            finally:
                watcher.close()
            ids = {f.id for f in status.findings}
        assert job.poll() is None  # named while the job still runs
    finally:
        job.terminate()
        job.wait(60)


def test_unsplit_iterable_dataset_named_and_the_split_removes_it(tmp_path: Path) -> None:
    f = pitfalls(launch(tmp_path / "as-written", "--iterable"))["data-not-sharded"]
    assert "index % world == rank" in f["recommendation"]
    assert any("batch values" in e["label"] for e in f["evidence"])
    fixed = launch(tmp_path / "fixed", "--iterable", "--split-by-rank")
    assert "data-not-sharded" not in pitfalls(fixed)
    assert {p["kind"] for p in events(fixed, "data-fingerprint")} == {"data"}


def test_sampler_seeded_with_the_rank_names_the_seed(tmp_path: Path) -> None:
    f = pitfalls(launch(tmp_path, "--seed-per-rank"))["sampler-seed-mismatch"]
    assert "DistributedSampler(dataset, seed=0)" in f["recommendation"]
    assert {e["label"]: e["value"] for e in f["evidence"]}["seed per rank"] == (
        "rank 0: 0, rank 1: 1"
    )
    assert "25 %" in f["expected_effect"]  # (1 - 1/2)^2 of the samples skipped per epoch


def test_dataparallel_named_with_ddp_under_launch(tmp_path: Path) -> None:
    f = pitfalls(launch(tmp_path, "--dataparallel"))["dataparallel-used"]
    assert "torchdoctor launch --nproc-per-node" in f["recommendation"]
    assert "DistributedDataParallel" in f["recommendation"]
    assert "significantly faster" in f["expected_effect"]  # PyTorch's words, cited
    assert "no GPU" in f["title"]


def test_batchnorm_with_a_small_batch_per_rank(tmp_path: Path) -> None:
    f = pitfalls(launch(tmp_path, "--batchnorm", "--batch", "8", "--samples", "256"))[
        "batchnorm-not-synced"
    ]
    assert "convert_sync_batchnorm(model)" in f["recommendation"]
    evidence = {e["label"]: e["value"] for e in f["evidence"]}
    assert evidence["batch per rank (median)"] == 8
    assert evidence["batch below which BN statistics degrade"] == 16


def test_accumulation_without_no_sync_and_the_fix(tmp_path: Path) -> None:
    args = ("--accumulate", "4", "--batch", "16")
    f = pitfalls(launch(tmp_path / "as-written", *args))["accumulation-without-no-sync"]
    assert "model.no_sync()" in f["recommendation"]
    assert "% 4" in f["recommendation"]
    assert "4 all-reduces per optimizer step" in f["title"]
    assert "3 all-reduce(s) fewer per optimizer step" in f["expected_effect"]
    fixed = launch(tmp_path / "fixed", *args, "--no-sync")
    assert "accumulation-without-no-sync" not in pitfalls(fixed)


def test_find_unused_parameters_with_none_unused(tmp_path: Path) -> None:
    f = pitfalls(launch(tmp_path, "--find-unused"))["unused-parameters-search"]
    assert "find_unused_parameters=False" in f["recommendation"]
    assert f["settings"]["saving_s_per_step"] > 0  # the search the agent timed


def test_fp16_autocast_without_scaler(tmp_path: Path) -> None:
    f = pitfalls(launch(tmp_path, "--fp16"))["fp16-without-scaler"]
    assert "scaler.scale(loss).backward()" in f["recommendation"]


def test_grad_scaler_skipping_every_step_is_named(tmp_path: Path) -> None:
    f = pitfalls(launch(tmp_path, "--fp16", "--scaler", "--overflow", "--samples", "4096"))[
        "grad-scale-falling"
    ]
    evidence = {e["label"]: e["value"] for e in f["evidence"]}
    assert evidence["skip rate"] == 100.0
    assert evidence["scale change per skip"] == "x 0.5"
    assert "scaler.unscale_(optimizer)" in f["recommendation"]


def test_single_process_demo_gets_none_of_the_pitfalls(tmp_path: Path) -> None:
    out = tmp_path / "demo.sqlite"
    res = run_td(
        "run", "--quiet", "--out", str(out), "--",
        sys.executable, str(REPO / "examples" / "train.py"), "--steps", "8", "--threads", "1",
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert pitfalls(out) == {}
