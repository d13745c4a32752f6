"""`torchdoctor.launch.scaling`: real trials at 1 and 2 ranks of a DDP script (gloo, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.helpers.schemas import assert_valid
from torchdoctor.errors import UserError
from torchdoctor.launch.scaling import Trial, parse_sizes, trial_args

JOB = str(Path(__file__).resolve().parent / "jobs" / "ddp_job.py")


def test_one_and_two_ranks_give_e2_and_say_where_the_loss_goes(tmp_path: Path) -> None:
    res = run_td(
        "bench", "scaling", "--nproc", "1,2", "--steps", "6", "--out-dir", str(tmp_path), "--json",
        "--", JOB,
        timeout=400,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    result = assert_valid("bench-scaling", res.stdout)
    trials = {t["nproc"]: t for t in result["trials"]}
    assert set(trials) == {1, 2}
    one, two = trials[1], trials[2]
    assert one["efficiency"] == 1.0 and one["samples_per_s"] > 0
    assert two["samples_per_s"] > 0 and two["measured_steps"] >= 6
    # E(2) is the definition applied to the two measured throughputs
    assert two["efficiency"] == pytest.approx(two["samples_per_s"] / (2 * one["samples_per_s"]))
    assert two["cores_per_rank"] == one["cores_per_rank"] / 2
    assert two["exposed_comm_s"] is not None and two["compute_s"] is not None
    (line,) = result["explanation"]
    assert line.startswith(f"2 ranks: E = {two['efficiency']:.2f}")
    assert f"{two['cores_per_rank']:g} cores per rank" in line and "Main loss: " in line
    assert result["recommendation"].startswith(
        ("Run 2 ranks", "Stay at 1 rank", "2 ranks measured")
    )
    assert one["others_cpu"] is not None
    assert (tmp_path / "scaling-1.sqlite").is_file() and (tmp_path / "scaling-2.sqlite").is_file()
    # diagnose of the 2-rank trial alone names scaling-no-gain from the 1-rank trial's
    # throughput in its meta, exactly when bench scaling's E(2) is below 0.7
    diagnosed = run_td("diagnose", "--json", str(tmp_path / "scaling-2.sqlite"))
    assert diagnosed.returncode == 0, diagnosed.stderr
    found = {f["id"]: f for f in json.loads(diagnosed.stdout)["findings"]}
    if two["efficiency"] < 0.7:
        evidence = {e["label"]: e["value"] for e in found["scaling-no-gain"]["evidence"]}
        assert evidence["E(2) = speed-up / 2"] == pytest.approx(two["efficiency"], abs=0.011)
    else:
        assert "scaling-no-gain" not in found
    alone = run_td("diagnose", "--json", str(tmp_path / "scaling-1.sqlite"))
    assert "scaling-no-gain" not in {f["id"] for f in json.loads(alone.stdout)["findings"]}


def test_sizes_and_kept_batch() -> None:
    assert parse_sizes("4,2") == [1, 2, 4]
    with pytest.raises(UserError, match="rank counts"):
        parse_sizes("a")
    args = ["t.py", "--batch", "{per_rank_batch}"]
    assert trial_args(args, "global-batch", 512, 4) == ["t.py", "--batch", "128"]
    assert trial_args(["t.py"], "per-rank-batch", None, 4) == ["t.py"]
    with pytest.raises(UserError, match="needs --global-batch B"):
        trial_args(["t.py"], "global-batch", 512, 2)
    with pytest.raises(UserError, match="does not split evenly"):
        trial_args(args, "global-batch", 500, 3)


def test_low_efficiency_names_cores_per_rank() -> None:
    from torchdoctor.launch.scaling import ScalingResult, analyse

    base = Trial(1, "a", 0, samples_per_s=1000, step_s=0.1, data_wait_s=0.001,
                 exposed_comm_s=0.0, compute_s=0.09, cores_per_rank=2, per_rank_batch=64)  # fmt: skip
    two = Trial(2, "b", 0, samples_per_s=1100, step_s=0.18, data_wait_s=0.001,
                exposed_comm_s=0.01, compute_s=0.17, straggle_s=0.0, cores_per_rank=1,
                per_rank_batch=64)  # fmt: skip
    result = ScalingResult(keep="per-rank-batch", trials=[base, two])
    analyse(result)
    assert two.efficiency == pytest.approx(0.55)
    assert result.recommendation.startswith("Stay at 1 rank on this node: 2 ranks give E(2) = 0.55")
    assert "1 cores per rank against 2 for one rank" in result.recommendation
